//! Who calls the etcd API. With `--grants`, a caller is known by its TLS client
//! certificate, as on the lockcell API, or by logging in: etcd's Authenticate with an
//! identity of the grants file as the user and that identity's bearer token as the
//! password. The token it answers is that bearer token, which the client sends back in
//! the `token` metadata of each later call, so every proxy checks it alike and nothing
//! is kept. Users and roles are the grants file's: their RPCs are refused by name.

use lockcell_proto::etcd_auth::auth_server::Auth;
use lockcell_proto::etcd_auth::{
    AuthenticateRequest, AuthenticateResponse, Ignored, ResponseHeader,
};
use tonic::{Request, Response, Status};

use super::EtcdApi;
use crate::access::{AccessRules, Right};

/// The metadata etcd's clients carry their auth token in.
const TOKEN: &str = "token";

impl EtcdApi {
    /// The caller's identity, or `None` when the proxy does not check grants.
    pub(super) fn caller<T>(&self, request: &Request<T>) -> Result<Option<String>, Status> {
        let grants = self.state.grants.current();
        // Another proxy's call for its client, on a lease that lives here: checked
        // whether or not this proxy checks grants, so no client turns forwarding off.
        if let Some(forwarded) = self.forwarded_caller(request.metadata()) {
            return match forwarded? {
                Some(_) if !grants.enforced() => Ok(None),
                Some(identity) => Ok(Some(identity)),
                None if !grants.enforced() => Ok(None),
                // A proxy without grants forwards no identity: here it would pass for
                // the owner of every lease and every right.
                None => Err(Status::unauthenticated(
                    "etcdserver: a call forwarded by a proxy that checks no grants names no identity, and this proxy checks grants: give every proxy of the cell the same grants file",
                )),
            };
        }
        if !grants.enforced() {
            return Ok(None);
        }
        if request.peer_certs().is_some() {
            return grants.identify(request).map(Some);
        }
        match request.metadata().get(TOKEN).map(|t| t.to_str()) {
            Some(Ok(token)) => grants.identity_of_token(token).map(Some),
            Some(Err(_)) => Err(Status::unauthenticated("etcdserver: invalid auth token")),
            None => Err(Status::unauthenticated(
                "etcdserver: user name is empty: this proxy checks prefix grants; log in with an identity of its grants file as the user and that identity's bearer token as the password, or present a TLS client certificate",
            )),
        }
    }
}

/// Why the auth management RPCs are refused.
fn managed_elsewhere(rpc: &str) -> Status {
    Status::unimplemented(format!(
        "{rpc} is not served through a lockcell proxy: identities and their rights are set in the proxy's grants file"
    ))
}

/// The Auth service: `authenticate` as given, every other method refused by name (the
/// attribute sees the methods once the macro has written them).
macro_rules! auth_service {
    ($($method:ident => $rpc:literal),* $(,)?) => {
        #[tonic::async_trait]
        impl Auth for EtcdApi {
            $(
                async fn $method(&self, _: Request<Ignored>) -> Result<Response<Ignored>, Status> {
                    Err(managed_elsewhere($rpc))
                }
            )*

            async fn authenticate(
                &self,
                request: Request<AuthenticateRequest>,
            ) -> Result<Response<AuthenticateResponse>, Status> {
                self.log_in(request.into_inner())
            }
        }
    };
}

auth_service! {
    auth_enable => "AuthEnable",
    auth_disable => "AuthDisable",
    auth_status => "AuthStatus",
    user_add => "UserAdd",
    user_get => "UserGet",
    user_list => "UserList",
    user_delete => "UserDelete",
    user_change_password => "UserChangePassword",
    user_grant_role => "UserGrantRole",
    user_revoke_role => "UserRevokeRole",
    role_add => "RoleAdd",
    role_get => "RoleGet",
    role_list => "RoleList",
    role_delete => "RoleDelete",
    role_grant_permission => "RoleGrantPermission",
    role_revoke_permission => "RoleRevokePermission",
}

impl EtcdApi {
    /// Authenticate: the password must be the bearer token of the identity named.
    fn log_in(&self, req: AuthenticateRequest) -> Result<Response<AuthenticateResponse>, Status> {
        let grants = self.state.grants.current();
        if !grants.enforced() {
            return Err(Status::failed_precondition(
                "etcdserver: authentication is not enabled (this proxy checks no prefix grants)",
            ));
        }
        let refused = || {
            Status::invalid_argument(
                "etcdserver: authentication failed, invalid user ID or password",
            )
        };
        let identity = grants
            .identity_of_token(&req.password)
            .map_err(|_| refused())?;
        if identity != req.name {
            return Err(refused());
        }
        let header = self.header(self.state.cell.seen());
        Ok(Response::new(AuthenticateResponse {
            header: Some(ResponseHeader {
                cluster_id: header.cluster_id,
                member_id: header.member_id,
                revision: header.revision,
                raft_term: header.raft_term,
            }),
            token: req.password,
        }))
    }
}

/// Checks `right` for `identity` on the client range from `key` to `range_end` (etcd's
/// forms): one key; else a prefix the grants cover that holds the whole range, the
/// longest first, so that a page of a prefix (a range that starts inside it) is judged as
/// the prefix is.
pub(super) fn check_range(
    grants: &AccessRules,
    identity: &str,
    right: Right,
    key: &[u8],
    range_end: &[u8],
) -> Result<(), Status> {
    if range_end.is_empty() {
        let key = std::str::from_utf8(key).map_err(|_| {
            Status::permission_denied("etcdserver: permission denied: a key that is not UTF-8 is outside every prefix grant")
        })?;
        return grants.check(identity, right, key);
    }
    let mut refused = None;
    for prefix in covering_prefixes(key, range_end) {
        match grants.check_prefix(identity, right, prefix) {
            Ok(()) => return Ok(()),
            Err(e) => {
                refused.get_or_insert(e);
            }
        }
    }
    Err(refused.unwrap_or_else(|| Status::permission_denied("etcdserver: permission denied")))
}

/// The prefixes that hold every key from `key` to `range_end`, longest first: the text
/// of `key` up to each `/` in it (and `key` itself when the range is exactly its
/// prefix), whose keys reach at least to `range_end`, then "" (every key).
fn covering_prefixes<'k>(key: &'k [u8], range_end: &[u8]) -> Vec<&'k str> {
    use lockcell_cell::keyspace::prefix_end;
    let mut prefixes = Vec::new();
    if key != [0] && range_end != [0] {
        let ends = (0..key.len())
            .filter(|&i| key[i] == b'/')
            .map(|i| i + 1)
            .chain((range_end == prefix_end(key).as_slice()).then_some(key.len()));
        for end in ends {
            let prefix = &key[..end];
            if prefix_end(prefix).as_slice() >= range_end {
                if let Ok(text) = std::str::from_utf8(prefix) {
                    prefixes.push(text);
                }
            }
        }
        prefixes.reverse();
    }
    prefixes.push("");
    prefixes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_of_a_prefix_is_held_by_the_prefix() {
        // The usual paging continuation of `alice/`: from just after the last key.
        assert_eq!(covering_prefixes(b"alice/a\0", b"alice0"), ["alice/", ""]);
        assert_eq!(covering_prefixes(b"alice/", b"alice/\xff"), ["alice/", ""]);
        assert_eq!(
            covering_prefixes(b"a/b/c", b"a/b/d"),
            ["a/b/c", "a/b/", "a/", ""]
        );
    }

    #[test]
    fn a_range_past_a_prefix_is_held_only_by_a_shorter_one() {
        assert_eq!(covering_prefixes(b"alice/x", b"bob/"), [""]);
        assert_eq!(covering_prefixes(b"a/b/x", b"a/c"), ["a/", ""]);
    }

    #[test]
    fn from_key_and_the_whole_space_are_held_only_by_every_key() {
        assert_eq!(covering_prefixes(b"alice/", b"\0"), [""]);
        assert_eq!(covering_prefixes(b"\0", b"\0"), [""]);
    }
}
