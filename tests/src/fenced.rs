//! A fenced test resource: it refuses a token lower than the highest it has accepted,
//! as a storage system that checks fencing tokens would.

use std::sync::Mutex;

use lockcell_proto::FencingToken;

/// Keeps the highest token seen and a log of what it accepted and refused.
#[derive(Default)]
pub struct FencedResource {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    highest: Option<FencingToken>,
    accepted: Vec<(String, FencingToken)>,
    refused: Vec<(String, FencingToken)>,
}

impl FencedResource {
    /// A write by `writer` carrying `token`: accepted unless a higher token was seen.
    pub fn write(&self, writer: &str, token: FencingToken) -> bool {
        let mut inner = self.inner.lock().expect("fenced resource");
        if inner.highest.is_some_and(|h| token < h) {
            inner.refused.push((writer.to_owned(), token));
            return false;
        }
        inner.highest = Some(token);
        inner.accepted.push((writer.to_owned(), token));
        true
    }

    pub fn highest(&self) -> Option<FencingToken> {
        self.inner.lock().expect("fenced resource").highest
    }

    pub fn accepted(&self) -> Vec<(String, FencingToken)> {
        self.inner.lock().expect("fenced resource").accepted.clone()
    }

    pub fn refused(&self) -> Vec<(String, FencingToken)> {
        self.inner.lock().expect("fenced resource").refused.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_lower_tokens_only() {
        let r = FencedResource::default();
        let t = |revision| FencingToken { epoch: 1, revision };
        assert!(r.write("a", t(5)));
        assert!(r.write("a", t(5)), "the current holder may write again");
        assert!(r.write("b", t(9)));
        assert!(!r.write("a", t(5)));
        assert_eq!(r.refused(), vec![("a".to_owned(), t(5))]);
        assert_eq!(r.highest(), Some(t(9)));
    }
}
