//! Who may touch what in the cell's etcd: the etcd users lockcell's processes log in as,
//! their roles' key permissions by prefix, and the one idempotent step that sets them up
//! and turns etcd authentication on (`lockcell-cell auth-enable`).
//!
//! | role (and user) | may | why |
//! | --- | --- | --- |
//! | `lockcell-proxy` | read every key; read and write `/l/`, `/q/`, `/k/`, `/s/` | holders, waiters, small keys and session fences are its to write; its one cell watch covers every key, so that every revision reaches it (the proxy's `feed` module) |
//! | `lockcell-tailer` | read every key | the audit tailer follows the whole cell and writes nothing to it |
//! | `lockcell-admin` | read every key; read and write `/sys/` and `/k/` | `lockcell-cell init` and `bump-epoch`, the shard map; a shard map move reads the locks, waiters and small keys of the names it moves, and copies and deletes their persistent small keys |
//! | `root` | everything | etcd wants it before it turns authentication on; for operators |
//!
//! etcd 3.4 asks no permission to grant or keep a lease alive; revoking one needs write
//! permission on every key attached to it, which a proxy has for the keys it attaches.

use std::fmt;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, GetOptions, RoleRevokePermissionOptions};

use crate::error::{with_timeout, CellError};
use crate::keyspace;

mod roles;

pub use roles::{plan, roles, Access, Grant, PermissionPlan, RoleSpec};

/// The proxies' etcd user; its role has the same name.
pub const PROXY_USER: &str = "lockcell-proxy";
/// The audit tailer's etcd user; its role has the same name.
pub const TAILER_USER: &str = "lockcell-tailer";
/// The user `lockcell-cell init`, `bump-epoch` and the shard map tools log in as; its
/// role has the same name.
pub const ADMIN_USER: &str = "lockcell-admin";
/// etcd's superuser: etcd refuses to turn authentication on without it.
pub const ROOT_USER: &str = "root";
/// etcd's built-in all-powerful role, held by [`ROOT_USER`].
pub const ROOT_ROLE: &str = "root";

/// An etcd user and password to log in with.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub user: String,
    pub password: String,
}

impl Credentials {
    pub fn new(user: impl Into<String>, password: impl Into<String>) -> Self {
        Credentials {
            user: user.into(),
            password: password.into(),
        }
    }
}

/// Never prints the password (configs and errors are logged).
impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("user", &self.user)
            .field("password", &"<hidden>")
            .finish()
    }
}

/// The password each of lockcell's etcd users is to have.
#[derive(Clone)]
pub struct Passwords {
    pub proxy: String,
    pub tailer: String,
    pub admin: String,
    pub root: String,
}

impl fmt::Debug for Passwords {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Passwords { <hidden> }")
    }
}

impl Passwords {
    /// Each user with its password and its role. Root comes last: changing a user's
    /// password ends its tokens, and the caller is logged in as root.
    fn users(&self) -> [(&'static str, &str, &'static str); 4] {
        [
            (PROXY_USER, &self.proxy, PROXY_USER),
            (TAILER_USER, &self.tailer, TAILER_USER),
            (ADMIN_USER, &self.admin, ADMIN_USER),
            (ROOT_USER, &self.root, ROOT_ROLE),
        ]
    }

    /// The credentials of `user` (one of lockcell's users).
    pub fn credentials(&self, user: &str) -> Option<Credentials> {
        self.users()
            .into_iter()
            .find(|(name, _, _)| *name == user)
            .map(|(name, password, _)| Credentials::new(name, password))
    }
}

/// One thing [`enable`] changed in etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    RoleAdded(&'static str),
    Granted {
        role: &'static str,
        grant: Grant,
    },
    Revoked {
        role: &'static str,
        grant: Grant,
    },
    UserAdded(&'static str),
    /// The user's password was not the one given (or could not be checked because
    /// authentication was still off), and now is.
    PasswordSet(&'static str),
    RoleGiven {
        user: &'static str,
        role: &'static str,
    },
    RoleTaken {
        user: &'static str,
        role: String,
    },
    AuthEnabled,
}

impl fmt::Display for Change {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Change::RoleAdded(role) => write!(f, "added the role {role}"),
            Change::Granted { role, grant } => write!(f, "granted {role} {grant}"),
            Change::Revoked { role, grant } => write!(f, "revoked {grant} from {role}"),
            Change::UserAdded(user) => write!(f, "added the user {user}"),
            Change::PasswordSet(user) => write!(f, "set the password of {user}"),
            Change::RoleGiven { user, role } => write!(f, "gave {user} the role {role}"),
            Change::RoleTaken { user, role } => write!(f, "took the role {role} from {user}"),
            Change::AuthEnabled => write!(f, "turned etcd authentication on"),
        }
    }
}

/// Why setting up access control failed.
#[derive(Debug, thiserror::Error)]
pub enum RbacError {
    #[error(transparent)]
    Cell(#[from] CellError),
    #[error("no password for the etcd user {user}: give it with {flag} (or {env})")]
    NoPassword {
        user: &'static str,
        flag: &'static str,
        env: &'static str,
    },
    #[error("etcd authentication is on and this client is not root: {0} (log in as root with LOCKCELL_ROOT_PASSWORD)")]
    NotRoot(String),
}

/// How etcd turned a call away for who made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No such user, or not its password.
    BadCredentials,
    /// A user was given, but etcd runs with authentication off.
    AuthOff,
    /// etcd runs with authentication on and the call named no user.
    NoUser,
    /// The user's roles do not allow the call.
    PermissionDenied,
    /// The call's token is unknown to the member: it expired (`--auth-token-ttl`, counted
    /// from the token's last use on that member) or the member restarted and forgot it.
    /// Logging in again cures it.
    TokenExpired,
}

/// What kind of refusal an etcd error message (a status message or a watch's cancel
/// reason) reports, if any.
pub fn refusal_in(message: &str) -> Option<Refusal> {
    // etcd 3.4's messages (etcdserver/api/v3rpc/rpctypes).
    [
        (
            "authentication failed, invalid user ID or password",
            Refusal::BadCredentials,
        ),
        ("authentication is not enabled", Refusal::AuthOff),
        ("user name is empty", Refusal::NoUser),
        ("permission denied", Refusal::PermissionDenied),
        ("invalid auth token", Refusal::TokenExpired),
    ]
    .into_iter()
    .find(|(text, _)| message.contains(text))
    .map(|(_, refusal)| refusal)
}

/// The refusal an etcd client error reports, if any.
pub fn refusal(error: &etcd_client::Error) -> Option<Refusal> {
    match error {
        etcd_client::Error::GRpcStatus(status) => refusal_in(status.message()),
        _ => None,
    }
}

/// `options` that log in as `credentials` (when given) and log in again whenever etcd
/// says the token expired. Without the second part a client that made no call for
/// `--auth-token-ttl` (lease keepalives do not count) has every call refused.
pub fn with_credentials(
    options: ConnectOptions,
    credentials: Option<&Credentials>,
) -> ConnectOptions {
    match credentials {
        Some(c) => options
            .with_user(c.user.clone(), c.password.clone())
            .with_auto_token_refresh(true),
        None => options,
    }
}

/// Default connect options for `credentials`; see [`with_credentials`].
pub fn connect_options(credentials: Option<&Credentials>) -> ConnectOptions {
    with_credentials(ConnectOptions::new(), credentials)
}

/// How often [`keep_token`] uses a token. etcd forgets a token nothing used for
/// `--auth-token-ttl` (300 s by default; each member counts on its own).
pub const TOKEN_USE_EVERY: Duration = Duration::from_secs(1);

/// Uses `client`'s token every [`TOKEN_USE_EVERY`] (a serializable count of the epoch
/// record, which a member answers from its own store), until every sender of `owner`
/// is gone.
///
/// etcd forgets a token nothing uses, and lease keepalives do not count. Calls it then
/// refuses are retried after logging in again ([`with_credentials`]), but a new watch
/// it turns away in-band, as a cancelled watch that the client never retries; this
/// keeps the token known, and the first use after etcd forgot it logs in again.
pub async fn keep_token<T>(
    client: Client,
    timeout: Duration,
    mut owner: tokio::sync::watch::Receiver<T>,
) {
    let mut kv = client.kv_client();
    let count = GetOptions::new().with_serializable().with_count_only();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(TOKEN_USE_EVERY) => {}
            changed = owner.changed() => match changed {
                Ok(()) => continue,
                Err(_) => return,
            },
        }
        let call = kv.get(keyspace::epoch_key(), Some(count.clone()));
        if let Err(e) = with_timeout("use the etcd token", timeout, call).await {
            tracing::debug!(error = %e, "keeping the etcd token in use failed");
        }
    }
}

/// Connects as root while authentication is on, and with no user while it is off:
/// how [`enable`] is reached on a new cell and on one set up before.
pub async fn connect_for_setup(
    endpoints: &[String],
    root_password: &str,
    options: ConnectOptions,
) -> Result<Client, CellError> {
    let root = Credentials::new(ROOT_USER, root_password);
    let as_root = with_credentials(options.clone(), Some(&root));
    match Client::connect(endpoints, Some(as_root)).await {
        Ok(client) => Ok(client),
        Err(e) if refusal(&e) == Some(Refusal::AuthOff) => {
            Client::connect(endpoints, Some(options))
                .await
                .map_err(|source| CellError::Etcd {
                    op: "connect",
                    source,
                })
        }
        Err(source) => Err(CellError::Etcd {
            op: "log in as root",
            source,
        }),
    }
}

/// Makes etcd's access control what lockcell wants and turns authentication on: the
/// roles of [`roles`] with exactly their permissions, the users `lockcell-proxy`,
/// `lockcell-tailer`, `lockcell-admin` and `root` with the given passwords and only
/// their own role, then authentication. `client` is root's once authentication is on
/// (see [`connect_for_setup`]). Returns what it changed: nothing on a cell already set
/// up this way.
pub async fn enable(
    client: &Client,
    passwords: &Passwords,
    timeout: Duration,
) -> Result<Vec<Change>, RbacError> {
    check(passwords)?;
    let mut auth = client.auth_client();
    let mut changes = Vec::new();

    let listed = with_timeout("list roles", timeout, auth.role_list())
        .await
        .map_err(not_root)?;
    let existing: Vec<String> = listed.roles().to_vec();
    let has_role = |name: &str| existing.iter().any(|r| r == name);
    if !has_role(ROOT_ROLE) {
        with_timeout("add role", timeout, auth.role_add(ROOT_ROLE)).await?;
        changes.push(Change::RoleAdded(ROOT_ROLE));
    }
    for role in roles() {
        if !has_role(role.name) {
            with_timeout("add role", timeout, auth.role_add(role.name)).await?;
            changes.push(Change::RoleAdded(role.name));
        }
        let got = with_timeout("get role", timeout, auth.role_get(role.name)).await?;
        let present: Vec<Grant> = got
            .permissions()
            .iter()
            .filter_map(Grant::from_etcd)
            .collect();
        let plan = plan(&role.grants, &present);
        for grant in plan.revoke {
            let keys = RoleRevokePermissionOptions::new().with_range_end(grant.range_end.clone());
            let call = auth.role_revoke_permission(role.name, grant.key.clone(), Some(keys));
            with_timeout("revoke permission", timeout, call).await?;
            changes.push(Change::Revoked {
                role: role.name,
                grant,
            });
        }
        for grant in plan.grant {
            let call = auth.role_grant_permission(role.name, grant.to_etcd());
            with_timeout("grant permission", timeout, call).await?;
            changes.push(Change::Granted {
                role: role.name,
                grant,
            });
        }
    }

    let auth_on = match log_in(&mut auth, ROOT_USER, &passwords.root, timeout).await? {
        Ok(()) | Err(Refusal::BadCredentials) => true,
        Err(Refusal::AuthOff) => false,
        Err(other) => {
            return Err(RbacError::NotRoot(format!(
                "logging in as root was refused ({other:?})"
            )))
        }
    };
    let listed = with_timeout("list users", timeout, auth.user_list()).await?;
    let users: Vec<String> = listed.users().to_vec();
    for (user, password, role) in passwords.users() {
        if !users.iter().any(|u| u == user) {
            with_timeout("add user", timeout, auth.user_add(user, password, None)).await?;
            changes.push(Change::UserAdded(user));
        } else if !auth_on || log_in(&mut auth, user, password, timeout).await?.is_err() {
            let call = auth.user_change_password(user, password);
            with_timeout("change password", timeout, call).await?;
            changes.push(Change::PasswordSet(user));
        }
        let got = with_timeout("get user", timeout, auth.user_get(user)).await?;
        let held: Vec<String> = got.roles().to_vec();
        if !held.iter().any(|r| r == role) {
            with_timeout("grant role", timeout, auth.user_grant_role(user, role)).await?;
            changes.push(Change::RoleGiven { user, role });
        }
        if user != ROOT_USER {
            for other in held.into_iter().filter(|r| r != role) {
                let call = auth.user_revoke_role(user, other.clone());
                with_timeout("revoke role", timeout, call).await?;
                changes.push(Change::RoleTaken { user, role: other });
            }
        }
    }
    if !auth_on {
        with_timeout("enable authentication", timeout, auth.auth_enable()).await?;
        changes.push(Change::AuthEnabled);
    }
    Ok(changes)
}

fn check(passwords: &Passwords) -> Result<(), RbacError> {
    let flags = [
        ("--proxy-password", "LOCKCELL_PROXY_PASSWORD"),
        ("--tailer-password", "LOCKCELL_TAILER_PASSWORD"),
        ("--admin-password", "LOCKCELL_ADMIN_PASSWORD"),
        ("--root-password", "LOCKCELL_ROOT_PASSWORD"),
    ];
    for ((user, password, _), (flag, env)) in passwords.users().into_iter().zip(flags) {
        if password.is_empty() {
            return Err(RbacError::NoPassword { user, flag, env });
        }
    }
    Ok(())
}

fn not_root(e: CellError) -> RbacError {
    match &e {
        CellError::Etcd { source, .. }
            if matches!(
                refusal(source),
                Some(Refusal::PermissionDenied | Refusal::NoUser)
            ) =>
        {
            RbacError::NotRoot(e.to_string())
        }
        _ => RbacError::Cell(e),
    }
}

/// Logs in as `user` without keeping the token: `Ok(Err(_))` when etcd refuses who it
/// is (a wrong password, authentication off).
async fn log_in(
    auth: &mut etcd_client::AuthClient,
    user: &str,
    password: &str,
    timeout: Duration,
) -> Result<Result<(), Refusal>, CellError> {
    let call = auth.authenticate(user.to_owned(), password.to_owned());
    match with_timeout("log in", timeout, call).await {
        Ok(_) => Ok(Ok(())),
        Err(CellError::Etcd { op, source }) => match refusal(&source) {
            Some(refused) => Ok(Err(refused)),
            None => Err(CellError::Etcd { op, source }),
        },
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_told_apart_by_etcds_messages() {
        let cases = [
            (
                "etcdserver: authentication failed, invalid user ID or password",
                Some(Refusal::BadCredentials),
            ),
            (
                "etcdserver: authentication is not enabled",
                Some(Refusal::AuthOff),
            ),
            ("etcdserver: user name is empty", Some(Refusal::NoUser)),
            (
                "etcdserver: permission denied",
                Some(Refusal::PermissionDenied),
            ),
            (
                "rpc error: code = Unauthenticated desc = etcdserver: invalid auth token",
                Some(Refusal::TokenExpired),
            ),
            ("etcdserver: request timed out", None),
        ];
        for (message, want) in cases {
            assert_eq!(refusal_in(message), want, "{message}");
        }
    }

    #[test]
    fn passwords_never_print() {
        let creds = Credentials::new("lockcell-proxy", "s3cret");
        assert!(!format!("{creds:?}").contains("s3cret"));
        let passwords = Passwords {
            proxy: "a1".into(),
            tailer: "b2".into(),
            admin: "c3".into(),
            root: "d4".into(),
        };
        let shown = format!("{passwords:?}");
        assert!(["a1", "b2", "c3", "d4"].iter().all(|p| !shown.contains(p)));
    }

    #[test]
    fn an_empty_password_names_its_flag() {
        let passwords = Passwords {
            proxy: "a".into(),
            tailer: String::new(),
            admin: "c".into(),
            root: "d".into(),
        };
        let e = check(&passwords).unwrap_err().to_string();
        assert!(
            e.contains("lockcell-tailer") && e.contains("--tailer-password"),
            "{e}"
        );
    }
}

/// A password from a flag or the environment: never shown by `Debug` (a configuration
/// printed for an operator, a panic message), only handed to etcd.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// The password itself, for logging in.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_empty() { "\"\"" } else { "\"***\"" })
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Secret(s.to_owned()))
    }
}

impl From<Secret> for String {
    fn from(secret: Secret) -> String {
        secret.0
    }
}

#[cfg(test)]
mod secret_tests {
    use super::Secret;

    #[test]
    fn a_secret_is_never_printed() {
        let s: Secret = "hunter2".parse().unwrap();
        assert_eq!(format!("{s:?}"), "\"***\"");
        assert_eq!(s.expose(), "hunter2");
    }
}
