//! [`PathIndex`]: which rules of a set may match a request's path, found
//! by the path's leading segments instead of by trying every rule, so a
//! set of a rule per tenant (`/tenants/42/{*rest}`) costs a request the
//! rules under its own prefix, not all of them.

use std::collections::HashMap;

use super::Rule;
use super::target::{Segment, Target};

/// The rules of a set by the literal segments their target starts with:
/// a rule sits at the node of its literal prefix (`/tenants/42/{*rest}`
/// at `tenants` → `42`; a gRPC method at its service → method; a rule of
/// every path at the root). A path may match only the rules on the nodes
/// its own segments lead through.
#[derive(Debug, Default)]
pub(super) struct PathIndex {
    root: Node,
}

#[derive(Debug, Default)]
struct Node {
    /// The rules whose literal prefix ends here, in the set's order.
    rules: Vec<usize>,
    children: HashMap<Box<str>, Node>,
}

impl PathIndex {
    pub(super) fn new(rules: &[Rule]) -> Self {
        let mut index = Self::default();
        for (i, rule) in rules.iter().enumerate() {
            if matches!(rule.target, Target::None) {
                // Matches no path.
                continue;
            }
            let mut node = &mut index.root;
            for literal in literal_prefix(&rule.target) {
                node = node.children.entry(literal.into()).or_default();
            }
            node.rules.push(i);
        }
        index
    }

    /// The rules that may match `path`, in the set's order (each still to
    /// be matched whole: a prefix says nothing of what follows it).
    pub(super) fn candidates(&self, path: &str) -> Vec<usize> {
        let mut found = self.root.rules.clone();
        let mut node = &self.root;
        if let Some(rest) = path.strip_prefix('/').filter(|rest| !rest.is_empty()) {
            for segment in rest.split('/') {
                let Some(child) = node.children.get(segment) else {
                    break;
                };
                found.extend_from_slice(&child.rules);
                node = child;
            }
        }
        // Nodes deeper down hold rules of any place in the set.
        found.sort_unstable();
        found
    }
}

/// The literal segments a target's paths all start with.
fn literal_prefix(target: &Target) -> Vec<&str> {
    match target {
        Target::Any => Vec::new(),
        Target::Path(segments) => segments
            .iter()
            .map_while(|segment| match segment {
                Segment::Literal(literal) => Some(literal.as_str()),
                Segment::Param | Segment::Rest => None,
            })
            .collect(),
        Target::None => Vec::new(),
        Target::Grpc { service, method } => {
            let mut prefix = vec![service.as_str()];
            prefix.extend(method.as_deref());
            prefix
        }
    }
}
