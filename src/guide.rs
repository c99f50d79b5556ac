#![doc = include_str!("docs/guide/index.md")]

/// A page of the guide, from its markdown; built without a feature, its
/// links to the feature's items lead to docs.rs (`links_without!`).
macro_rules! page {
    ($name:ident) => {
        pub mod $name {
            #![doc = include_str!(concat!("docs/guide/", stringify!($name), ".md"))]
            #![cfg_attr(not(feature = "redis"), doc = links_without!("redis"))]
            #![cfg_attr(not(feature = "cluster"), doc = links_without!("cluster"))]
            #![cfg_attr(not(feature = "sentinel"), doc = links_without!("sentinel"))]
            #![cfg_attr(not(feature = "tls"), doc = links_without!("tls"))]
            #![cfg_attr(not(feature = "admin"), doc = links_without!("admin"))]
            #![cfg_attr(not(feature = "metrics"), doc = links_without!("metrics"))]
            #![cfg_attr(not(feature = "envoy"), doc = links_without!("envoy"))]
        }
    };
}

page!(policies);
page!(keys);
page!(responses);
page!(stacking);
page!(rules);
page!(budgets);
page!(ai_gateways);
page!(calendar);
page!(engine);
page!(testing);
page!(redis);
page!(supported);
page!(production);
page!(memory);
page!(cancellation);
page!(operating);
page!(deployments);
page!(envoy);
page!(writing_a_store);
