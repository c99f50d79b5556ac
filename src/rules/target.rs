//! What a rule matches besides the method: every request, a path pattern
//! (as axum routes are written), or a gRPC method or service.

/// What a rule matches besides the method.
#[derive(Debug, Clone)]
pub(super) enum Target {
    /// Every request.
    Any,
    /// A path pattern: literal segments, `{name}` (one segment), a final
    /// `{*name}` (one segment or more).
    Path(Vec<Segment>),
    /// A gRPC method, `/package.Service/Method`, or a whole service,
    /// `/package.Service/*`.
    Grpc {
        service: String,
        method: Option<String>,
    },
    /// No HTTP request: a rule for Envoy's descriptors alone.
    None,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Segment {
    Literal(String),
    Param,
    Rest,
}

impl Target {
    /// Whether a request of `path` (a gRPC call's: `/package.Service/Method`)
    /// is one this target matches.
    pub(super) fn matches(&self, path: &str) -> bool {
        match self {
            Self::Any => true,
            Self::Path(pattern) => path_matches(pattern, path),
            Self::Grpc { service, method } => {
                let Some((s, m)) = path.strip_prefix('/').and_then(|p| p.split_once('/')) else {
                    return false;
                };
                s == service && method.as_deref().is_none_or(|method| method == m)
            }
            Self::None => false,
        }
    }
}

/// `/users/{id}/posts/{*rest}` as segments.
pub(super) fn parse_path(pattern: &str) -> Result<Vec<Segment>, String> {
    let Some(rest) = pattern.strip_prefix('/') else {
        return Err(format!("{pattern:?} does not start with `/`"));
    };
    if pattern.contains(['?', '#']) {
        return Err(format!(
            "{pattern:?} holds `?` or `#`: the query and the fragment are not part of the \
             path a rule matches, so this rule would never match; write the path alone"
        ));
    }
    if rest.is_empty() {
        return Ok(Vec::new());
    }
    let parts: Vec<&str> = rest.split('/').collect();
    let mut segments = Vec::with_capacity(parts.len());
    for (i, part) in parts.iter().enumerate() {
        let segment = if let Some(inner) = part.strip_prefix('{').and_then(|p| p.strip_suffix('}'))
        {
            match inner.strip_prefix('*') {
                Some(name) if !name.is_empty() && i + 1 == parts.len() => Segment::Rest,
                Some(_) if i + 1 != parts.len() => {
                    return Err(format!(
                        "{pattern:?}: a `{{*name}}` segment must be the last"
                    ));
                }
                Some(_) => {
                    return Err(format!("{pattern:?}: `{{*}}` needs a name, as `{{*rest}}`"));
                }
                None if inner.is_empty() || inner.contains(['{', '}']) => {
                    return Err(format!("{pattern:?}: `{part}` is not a `{{name}}` segment"));
                }
                None => Segment::Param,
            }
        } else if part.contains(['{', '}']) {
            return Err(format!(
                "{pattern:?}: `{part}` mixes braces into a literal segment"
            ));
        } else if part.is_empty() && i + 1 != parts.len() {
            return Err(format!("{pattern:?} has an empty segment (`//`)"));
        } else {
            Segment::Literal((*part).to_owned())
        };
        segments.push(segment);
    }
    Ok(segments)
}

pub(super) fn path_matches(pattern: &[Segment], path: &str) -> bool {
    let Some(rest) = path.strip_prefix('/') else {
        return false;
    };
    // The path's segments, read as the pattern goes (no allocation: every
    // request is matched against every rule).
    let mut parts = rest.split('/').filter(|_| !rest.is_empty());
    for segment in pattern {
        match segment {
            Segment::Rest => return parts.any(|p| !p.is_empty()),
            Segment::Param => {
                if parts.next().is_none_or(str::is_empty) {
                    return false;
                }
            }
            Segment::Literal(literal) => {
                if parts.next() != Some(literal.as_str()) {
                    return false;
                }
            }
        }
    }
    parts.next().is_none()
}

/// `/package.Service/Method` or `/package.Service/*`.
pub(super) fn parse_grpc(text: &str) -> Result<Target, String> {
    let shape = || format!("{text:?} is not `/package.Service/Method` or `/package.Service/*`");
    let (service, method) = text
        .strip_prefix('/')
        .and_then(|t| t.split_once('/'))
        .ok_or_else(shape)?;
    if service.is_empty() || method.is_empty() || method.contains('/') {
        return Err(shape());
    }
    Ok(Target::Grpc {
        service: service.to_owned(),
        method: (method != "*").then(|| method.to_owned()),
    })
}
