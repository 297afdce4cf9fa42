//! The fencing token: (epoch, create revision of the holder key).
//!
//! etcd's revision rises with every write, and a grant is the creation of the holder
//! key, so every grant of a lock gets a larger create revision than the one before. The
//! epoch is raised when the cell is restored from a backup (revisions could repeat), so
//! it orders first.

use std::fmt;
use std::str::FromStr;

/// A grant's fencing token. Larger means later; a resource refuses a token lower than
/// the highest it has seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken {
    /// The cell's epoch when the grant was made.
    pub epoch: u64,
    /// The etcd create revision of the holder key.
    pub revision: i64,
}

/// A token's text form did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("fencing token {0:?} is not of the form EPOCH:REVISION (two whole numbers, e.g. 1:4521)")]
pub struct TokenParseError(pub String);

impl fmt::Display for FencingToken {
    /// `EPOCH:REVISION`, e.g. `1:4521`. Compare tokens as number pairs, not as text.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.epoch, self.revision)
    }
}

impl FromStr for FencingToken {
    type Err = TokenParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || TokenParseError(s.to_owned());
        let (epoch, revision) = s.split_once(':').ok_or_else(err)?;
        let epoch = epoch.parse().map_err(|_| err())?;
        let revision: i64 = revision.parse().map_err(|_| err())?;
        if revision <= 0 {
            return Err(err());
        }
        Ok(FencingToken { epoch, revision })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_by_epoch_then_revision() {
        let t = |epoch, revision| FencingToken { epoch, revision };
        assert!(t(1, 9) < t(1, 10));
        assert!(t(1, 1_000_000) < t(2, 1));
        assert_eq!(t(3, 7), t(3, 7));
    }

    #[test]
    fn text_form_round_trips() {
        let token = FencingToken {
            epoch: 1,
            revision: 4521,
        };
        assert_eq!(token.to_string(), "1:4521");
        assert_eq!("1:4521".parse::<FencingToken>(), Ok(token));
        for bad in ["", "1", "1:", ":2", "a:2", "1:b", "1:0", "1:-3", "1.2"] {
            assert!(bad.parse::<FencingToken>().is_err(), "{bad}");
        }
    }
}
