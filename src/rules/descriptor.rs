//! Descriptor rules: what a rule matches of a request to Envoy's rate
//! limit service (a domain, and a descriptor's entries in order), and
//! [`DescriptorIndex`], which finds a descriptor's rules the way Envoy's
//! reference server walks its configuration.

#[cfg(feature = "envoy")]
use std::collections::HashMap;

/// What a descriptor rule matches: a domain, and one matcher per entry of
/// the descriptor, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Descriptor {
    domain: String,
    entries: Vec<EntryMatch>,
}

/// One entry of a descriptor rule: the entry's key, and which values.
#[derive(Debug, Clone, PartialEq, Eq)]
struct EntryMatch {
    key: String,
    value: ValueMatch,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum ValueMatch {
    /// `key`: any value (the reference server's "default" descriptor).
    Any,
    /// `key=value`.
    Exact(String),
    /// `key=pre*fix`: `*` stands for any text (none included); the
    /// pattern as written, and split on `*`.
    Wildcard(String, Vec<String>),
}

impl Descriptor {
    /// The descriptor of `domain` whose entries are written `entries`:
    /// `key` (any value), `key=value`, or a value with `*` standing for
    /// any text (`key=/api/*`).
    pub(super) fn parse(domain: &str, entries: &[String]) -> Result<Self, String> {
        if entries.is_empty() {
            return Err(
                "a descriptor needs at least one entry (`\"key\"` or `\"key=value\"`)".to_owned(),
            );
        }
        Self::place(domain, entries)
    }

    /// A place of a reference-server configuration, written as
    /// [`parse`](Self::parse) reads a descriptor: its domain alone when
    /// `entries` is empty.
    pub(super) fn place(domain: &str, entries: &[String]) -> Result<Self, String> {
        if domain.trim().is_empty() {
            return Err("the domain is empty".to_owned());
        }
        let entries = entries
            .iter()
            .map(|entry| {
                let (key, value) = match entry.split_once('=') {
                    Some((key, value)) => (key, Some(value)),
                    None => (entry.as_str(), None),
                };
                if key.is_empty() {
                    return Err(format!("{entry:?} has no key"));
                }
                let value = match value {
                    None => ValueMatch::Any,
                    Some(value) if value.contains('*') => ValueMatch::Wildcard(
                        value.to_owned(),
                        value.split('*').map(str::to_owned).collect(),
                    ),
                    Some(value) => ValueMatch::Exact(value.to_owned()),
                };
                Ok(EntryMatch {
                    key: key.to_owned(),
                    value,
                })
            })
            .collect::<Result<_, String>>()?;
        Ok(Self {
            domain: domain.to_owned(),
            entries,
        })
    }

    /// The domain.
    pub fn domain(&self) -> &str {
        &self.domain
    }

    /// Whether an entry of this key is matched.
    pub(super) fn has_key(&self, key: &str) -> bool {
        self.entries.iter().any(|entry| entry.key == key)
    }

    /// The entries as written (`key`, `key=value`, `key=pre*`).
    pub fn entries(&self) -> impl Iterator<Item = String> + '_ {
        self.entries.iter().map(|entry| match &entry.value {
            ValueMatch::Any => entry.key.clone(),
            ValueMatch::Exact(value) | ValueMatch::Wildcard(value, _) => {
                format!("{}={value}", entry.key)
            }
        })
    }
}

/// The entries of a descriptor rule's descriptor that say what a
/// descriptor's `hits_addend` counts (`usage = { model = "model", kind =
/// "token_kind" }`): the model whose tokens they are, and their kind
/// (`input`, `cached_input`, `output`, or any kind the price catalog
/// names). Like a `tier_entry`, they are entries of the rule's descriptor
/// left out of its key: the models and kinds of one key spend one budget.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct UsageEntries {
    /// The entry whose value is the model.
    pub(crate) model: Option<String>,
    /// The entry whose value is the kind of tokens.
    pub(crate) kind: Option<String>,
}

impl UsageEntries {
    /// Whether `key` is the model's entry or the kind's.
    #[cfg_attr(not(feature = "envoy"), allow(dead_code))]
    pub(crate) fn names(&self, key: &str) -> bool {
        self.model.as_deref() == Some(key) || self.kind.as_deref() == Some(key)
    }
}

#[cfg(feature = "envoy")]
/// Whether `value` is `parts` joined with any text in place of each `*`.
fn wildcard_matches(parts: &[String], value: &str) -> bool {
    let [first, middle @ .., last] = parts else {
        return parts.first().is_some_and(|only| only == value);
    };
    if value.len() < parts.iter().map(String::len).sum::<usize>() {
        return false;
    }
    let Some(mut rest) = value
        .strip_prefix(first.as_str())
        .and_then(|rest| rest.strip_suffix(last.as_str()))
    else {
        return false;
    };
    for part in middle {
        let Some(at) = rest.find(part.as_str()) else {
            return false;
        };
        rest = &rest[at + part.len()..];
    }
    true
}

/// The descriptor rules of a set, by domain, as a tree of their entries:
/// a descriptor finds its rules by walking it entry by entry, taking at
/// each level the node of the entry's exact value, else the first whose
/// wildcard matches it, else the node of any value; its rules are those
/// of the node its last entry reaches (none when it runs out of nodes
/// first, or has more entries than the rules: as Envoy's reference server
/// decides).
#[cfg(feature = "envoy")]
#[derive(Debug, Default)]
pub(super) struct DescriptorIndex {
    domains: HashMap<String, Node>,
}

#[cfg(feature = "envoy")]
#[derive(Debug, Default)]
struct Node {
    /// The rules ending here, in the set's order.
    rules: Vec<usize>,
    /// By key, then value.
    exact: HashMap<String, HashMap<String, Node>>,
    /// In the order the rules wrote them: the first that matches wins.
    wildcards: Vec<(String, Vec<String>, String, Node)>,
    any: HashMap<String, Node>,
}

#[cfg(feature = "envoy")]
impl Node {
    fn is_leaf(&self) -> bool {
        self.exact.is_empty() && self.wildcards.is_empty() && self.any.is_empty()
    }

    fn child(&mut self, entry: &EntryMatch) -> &mut Node {
        match &entry.value {
            ValueMatch::Any => self.any.entry(entry.key.clone()).or_default(),
            ValueMatch::Exact(value) => self
                .exact
                .entry(entry.key.clone())
                .or_default()
                .entry(value.clone())
                .or_default(),
            ValueMatch::Wildcard(pattern, parts) => {
                let at = self
                    .wildcards
                    .iter()
                    .position(|(key, _, written, _)| *key == entry.key && written == pattern);
                let at = at.unwrap_or_else(|| {
                    self.wildcards.push((
                        entry.key.clone(),
                        parts.clone(),
                        pattern.clone(),
                        Node::default(),
                    ));
                    self.wildcards.len() - 1
                });
                &mut self.wildcards[at].3
            }
        }
    }

    fn next(&self, key: &str, value: &str) -> Option<&Node> {
        if let Some(node) = self.exact.get(key).and_then(|values| values.get(value)) {
            return Some(node);
        }
        if let Some((_, _, _, node)) = self
            .wildcards
            .iter()
            .find(|(k, parts, _, _)| k == key && wildcard_matches(parts, value))
        {
            return Some(node);
        }
        self.any.get(key)
    }
}

#[cfg(feature = "envoy")]
impl DescriptorIndex {
    /// The index of the descriptor rules among `rules` (`descriptor(i)`:
    /// rule `i`'s descriptor, if it is a descriptor rule), and of `places`
    /// that hold no rule: a descriptor that reaches one is limited by
    /// nothing, as a value the reference server whitelists.
    pub(super) fn new<'a>(
        count: usize,
        descriptor: impl Fn(usize) -> Option<&'a Descriptor>,
        places: &[Descriptor],
    ) -> Self {
        let mut index = Self::default();
        for place in places {
            index.node(place);
        }
        for i in 0..count {
            let Some(d) = descriptor(i) else { continue };
            index.node(d).rules.push(i);
        }
        index
    }

    /// The node of `descriptor`, made if need be.
    fn node(&mut self, descriptor: &Descriptor) -> &mut Node {
        let mut node = self.domains.entry(descriptor.domain.clone()).or_default();
        for entry in &descriptor.entries {
            node = node.child(entry);
        }
        node
    }

    /// Whether `domain` is a domain of the rules (the reference server
    /// looks a descriptor's own `limit` up only in a domain it knows).
    pub(super) fn knows(&self, domain: &str) -> bool {
        self.domains.contains_key(domain)
    }

    /// The rules a descriptor of `domain` with `entries` (key, value)
    /// matches, in the set's order.
    pub(super) fn rules<'a>(&'a self, domain: &str, entries: &[(&str, &str)]) -> &'a [usize] {
        let Some(mut node) = self.domains.get(domain) else {
            return &[];
        };
        for (i, (key, value)) in entries.iter().enumerate() {
            let Some(next) = node.next(key, value) else {
                return &[];
            };
            if i + 1 == entries.len() {
                return &next.rules;
            }
            if next.is_leaf() {
                return &[];
            }
            node = next;
        }
        &[]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "envoy")]
    fn parts(pattern: &str) -> Vec<String> {
        pattern.split('*').map(str::to_owned).collect()
    }

    #[cfg(feature = "envoy")]
    #[test]
    fn wildcards_match_any_text_in_place_of_each_star() {
        for (pattern, value, matches) in [
            ("/api/*", "/api/items", true),
            ("/api/*", "/api/", true),
            ("/api/*", "/ap", false),
            ("*", "", true),
            ("a*b*c", "abc", true),
            ("a*b*c", "a-b-c", true),
            ("a*b*c", "acb", false),
            ("ab*ba", "aba", false),
            ("*end", "the end", true),
            ("*end", "endless", false),
            ("exact", "exact", true),
        ] {
            assert_eq!(
                wildcard_matches(&parts(pattern), value),
                matches,
                "{pattern:?} {value:?}"
            );
        }
    }

    #[cfg(feature = "envoy")]
    #[test]
    fn a_descriptor_walks_to_its_rules_as_the_reference_server_does() {
        let d = |entries: &[&str]| {
            Descriptor::parse(
                "edge",
                &entries.iter().map(|e| (*e).to_owned()).collect::<Vec<_>>(),
            )
            .unwrap()
        };
        let rules = [
            d(&["remote_address"]),   // 0: any address
            d(&["path=/login"]),      // 1
            d(&["path=/api/*"]),      // 2
            d(&["path"]),             // 3: any other path
            d(&["user", "plan=pro"]), // 4
            d(&["user", "plan"]),     // 5
            d(&["key=v"]),            // 6: a leaf
            d(&["key", "nested"]),    // 7
            d(&["remote_address"]),   // 8: a second rule on one node
        ];
        let index = DescriptorIndex::new(rules.len(), |i| rules.get(i), &[]);
        let find = |entries: &[(&str, &str)]| index.rules("edge", entries).to_vec();
        assert_eq!(find(&[("remote_address", "10.0.0.1")]), [0, 8]);
        assert_eq!(find(&[("path", "/login")]), [1]);
        assert_eq!(find(&[("path", "/api/items")]), [2]);
        assert_eq!(find(&[("path", "/other")]), [3]);
        assert_eq!(find(&[("user", "u1"), ("plan", "pro")]), [4]);
        assert_eq!(find(&[("user", "u1"), ("plan", "free")]), [5]);
        // Fewer entries than the rules: the node reached has no rule.
        assert!(find(&[("user", "u1")]).is_empty());
        // More entries than the rules: none.
        assert!(find(&[("path", "/login"), ("extra", "x")]).is_empty());
        // The exact value is taken first, and is a leaf: the rule of any
        // value with a nested entry is not reached (as the reference).
        assert!(find(&[("key", "v"), ("nested", "x")]).is_empty());
        assert_eq!(find(&[("key", "w"), ("nested", "x")]), [7]);
        assert!(find(&[("unknown", "x")]).is_empty());
        assert!(
            index
                .rules("other-domain", &[("path", "/login")])
                .is_empty()
        );
    }

    #[test]
    fn bad_descriptors_are_refused() {
        assert!(Descriptor::parse("", &["k".to_owned()]).is_err());
        assert!(Descriptor::parse("d", &[]).is_err());
        assert!(Descriptor::parse("d", &["=v".to_owned()]).is_err());
    }
}
