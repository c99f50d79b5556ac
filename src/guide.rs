#![doc = include_str!("docs/guide/index.md")]

pub mod policies {
    #![doc = include_str!("docs/guide/policies.md")]
}

pub mod keys {
    #![doc = include_str!("docs/guide/keys.md")]
}

pub mod responses {
    #![doc = include_str!("docs/guide/responses.md")]
}

pub mod stacking {
    #![doc = include_str!("docs/guide/stacking.md")]
}

pub mod rules {
    #![doc = include_str!("docs/guide/rules.md")]
}

pub mod budgets {
    #![doc = include_str!("docs/guide/budgets.md")]
}

pub mod calendar {
    #![doc = include_str!("docs/guide/calendar.md")]
}

pub mod engine {
    #![doc = include_str!("docs/guide/engine.md")]
}

pub mod testing {
    #![doc = include_str!("docs/guide/testing.md")]
}

pub mod redis {
    #![doc = include_str!("docs/guide/redis.md")]
}

pub mod supported {
    #![doc = include_str!("docs/guide/supported.md")]
}

pub mod production {
    #![doc = include_str!("docs/guide/production.md")]
}

pub mod memory {
    #![doc = include_str!("docs/guide/memory.md")]
}

pub mod cancellation {
    #![doc = include_str!("docs/guide/cancellation.md")]
}

pub mod operating {
    #![doc = include_str!("docs/guide/operating.md")]
}

pub mod deployments {
    #![doc = include_str!("docs/guide/deployments.md")]
}
