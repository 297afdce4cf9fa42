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

/// The metadata etcd's clients carry their auth token in.
const TOKEN: &str = "token";

impl EtcdApi {
    /// The caller's identity, or `None` when the proxy does not check grants.
    pub(super) fn caller<T>(&self, request: &Request<T>) -> Result<Option<String>, Status> {
        let grants = self.state.grants.current();
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
