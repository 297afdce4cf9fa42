//! lockcell's roles as data: each role's key permissions, and the plan that brings a
//! role as etcd has it to exactly those. No etcd here; [`super::enable`] carries the
//! plan out.

use std::fmt;

use etcd_client::{Permission, PermissionType};

use super::{ADMIN_USER, PROXY_USER, TAILER_USER};
use crate::keyspace;

/// What a permission lets its holders do with its keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Read,
    Write,
    ReadWrite,
}

impl Access {
    pub(super) fn to_etcd(self) -> PermissionType {
        match self {
            Access::Read => PermissionType::Read,
            Access::Write => PermissionType::Write,
            Access::ReadWrite => PermissionType::Readwrite,
        }
    }

    pub(super) fn from_etcd(kind: i32) -> Option<Self> {
        match PermissionType::try_from(kind).ok()? {
            PermissionType::Read => Some(Access::Read),
            PermissionType::Write => Some(Access::Write),
            PermissionType::Readwrite => Some(Access::ReadWrite),
        }
    }
}

/// One key permission of a role: `access` to the keys in `[key, range_end)`, as etcd
/// stores it (a `range_end` of `"\0"` runs to the end of the key space).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub access: Access,
    pub key: Vec<u8>,
    pub range_end: Vec<u8>,
}

impl Grant {
    /// `access` to every key that starts with `prefix`.
    pub fn prefix(access: Access, prefix: &str) -> Self {
        Grant {
            access,
            key: prefix.as_bytes().to_vec(),
            range_end: keyspace::prefix_end(prefix.as_bytes()),
        }
    }

    /// `access` to the whole key space (etcd keys are never empty, so `"\0"` is the first).
    pub fn everything(access: Access) -> Self {
        Grant {
            access,
            key: vec![0],
            range_end: vec![0],
        }
    }

    fn same_keys(&self, other: &Grant) -> bool {
        self.key == other.key && self.range_end == other.range_end
    }

    pub(super) fn to_etcd(&self) -> Permission {
        Permission::new(self.access.to_etcd(), self.key.clone())
            .with_range_end(self.range_end.clone())
    }

    pub(super) fn from_etcd(permission: &Permission) -> Option<Self> {
        Some(Grant {
            access: Access::from_etcd(permission.get_type())?,
            key: permission.key().to_vec(),
            range_end: permission.range_end().to_vec(),
        })
    }
}

impl fmt::Display for Grant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let access = match self.access {
            Access::Read => "read",
            Access::Write => "write",
            Access::ReadWrite => "readwrite",
        };
        let key = String::from_utf8_lossy(&self.key);
        if self.key == [0] && self.range_end == [0] {
            write!(f, "{access} on every key")
        } else if self.range_end.is_empty() {
            write!(f, "{access} on the key {key}")
        } else if self.range_end == keyspace::prefix_end(&self.key) {
            write!(f, "{access} on the prefix {key}")
        } else {
            let end = String::from_utf8_lossy(&self.range_end);
            write!(f, "{access} on [{key:?}, {end:?})")
        }
    }
}

/// A lockcell role and the permissions it has, exactly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoleSpec {
    pub name: &'static str,
    pub grants: Vec<Grant>,
}

/// lockcell's roles (root's is etcd's own and not listed).
pub fn roles() -> Vec<RoleSpec> {
    let proxy_writes = [
        keyspace::locks_root(),
        keyspace::queues_root(),
        keyspace::kv_root(),
        keyspace::sessions_root(),
    ];
    let mut proxy = vec![Grant::everything(Access::Read)];
    proxy.extend(
        proxy_writes
            .iter()
            .map(|root| Grant::prefix(Access::ReadWrite, root)),
    );
    vec![
        RoleSpec {
            name: PROXY_USER,
            grants: proxy,
        },
        RoleSpec {
            name: TAILER_USER,
            grants: vec![Grant::everything(Access::Read)],
        },
        // The cell's records, and what a shard map move does: it reads the locks,
        // waiters and small keys of the names it moves, and copies and deletes their
        // persistent small keys.
        RoleSpec {
            name: ADMIN_USER,
            grants: vec![
                Grant::everything(Access::Read),
                Grant::prefix(Access::ReadWrite, keyspace::sys_root()),
                Grant::prefix(Access::ReadWrite, keyspace::kv_root()),
            ],
        },
    ]
}

/// What to change so that a role with the permissions `present` has exactly `wanted`.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PermissionPlan {
    /// Wanted and missing, or present with other access (a grant over the same keys
    /// replaces the access in etcd).
    pub grant: Vec<Grant>,
    /// Present over keys no wanted permission covers.
    pub revoke: Vec<Grant>,
}

/// Compares a role's permissions with the wanted ones.
pub fn plan(wanted: &[Grant], present: &[Grant]) -> PermissionPlan {
    PermissionPlan {
        grant: wanted
            .iter()
            .filter(|w| !present.contains(w))
            .cloned()
            .collect(),
        revoke: present
            .iter()
            .filter(|p| !wanted.iter().any(|w| w.same_keys(p)))
            .cloned()
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn role(name: &str) -> RoleSpec {
        roles().into_iter().find(|r| r.name == name).unwrap()
    }

    #[test]
    fn the_proxy_writes_only_its_four_prefixes() {
        let proxy = role(PROXY_USER);
        let writes: Vec<String> = proxy
            .grants
            .iter()
            .filter(|g| g.access != Access::Read)
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            writes,
            [
                "readwrite on the prefix /l/",
                "readwrite on the prefix /q/",
                "readwrite on the prefix /k/",
                "readwrite on the prefix /s/",
            ]
        );
        assert!(proxy.grants.contains(&Grant::everything(Access::Read)));
        assert!(!writes.iter().any(|w| w.contains("/sys/")));
    }

    #[test]
    fn the_tailer_only_reads_and_the_admin_writes_only_sys_and_small_keys() {
        assert_eq!(role(TAILER_USER).grants, [Grant::everything(Access::Read)]);
        let admin: Vec<String> = role(ADMIN_USER)
            .grants
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            admin,
            [
                "read on every key",
                "readwrite on the prefix /sys/",
                "readwrite on the prefix /k/",
            ]
        );
        assert!(keyspace::epoch_key().starts_with(keyspace::sys_root()));
        assert!(keyspace::shardmap_key().starts_with(keyspace::sys_root()));
    }

    #[test]
    fn a_prefix_grant_ends_where_etcd_ends_a_prefix() {
        let g = Grant::prefix(Access::Read, "/l/");
        assert_eq!(g.range_end, b"/l0");
        assert_eq!(
            Grant::everything(Access::Read).to_string(),
            "read on every key"
        );
    }

    #[test]
    fn a_role_that_matches_needs_nothing() {
        let wanted = role(PROXY_USER).grants;
        assert_eq!(plan(&wanted, &wanted), PermissionPlan::default());
        let mut shuffled = wanted.clone();
        shuffled.reverse();
        assert_eq!(plan(&wanted, &shuffled), PermissionPlan::default());
    }

    #[test]
    fn missing_is_granted_extra_is_revoked_and_wrong_access_is_regranted() {
        let wanted = vec![
            Grant::prefix(Access::ReadWrite, "/l/"),
            Grant::prefix(Access::Read, "/sys/"),
        ];
        let present = vec![
            Grant::prefix(Access::Read, "/l/"),
            Grant::prefix(Access::ReadWrite, "/x/"),
        ];
        let plan = plan(&wanted, &present);
        assert_eq!(
            plan.grant, wanted,
            "/l/ with the wrong access and /sys/ missing"
        );
        assert_eq!(plan.revoke, [Grant::prefix(Access::ReadWrite, "/x/")]);
    }
}
