//! Lock classes (docs/lock-classes.md): the rules a lock name's prefix brings with it —
//! session TTL bounds, modes, fencing, fairness and lock-delay — declared in a TOML file
//! kept in Git, and the [`ClassBook`] that keeps the last good file in force across
//! reloads.
//!
//! The file format and its rules live in [`loader`]; docs/lock-classes.md is the guide.

mod loader;

use std::path::Path;
use std::time::Duration;

use crate::declared::FileError;

/// The rules for every lock whose name starts with `prefix`.
#[derive(Debug, Clone, PartialEq)]
pub struct LockClass {
    /// Named in every refusal, so a client learns which class turned it away.
    pub name: String,
    /// The lock names the class covers; `""` only for the default class.
    pub prefix: String,
    /// Sessions with a shorter TTL may not lock the class's names: they would lose
    /// their locks at the first pause.
    pub ttl_min: Duration,
    /// Sessions with a longer TTL may not lock the class's names: a dead holder would
    /// keep the lock that long.
    pub ttl_max: Duration,
    /// Whether exclusive acquires are allowed.
    pub exclusive: bool,
    /// Whether shared acquires are allowed.
    pub shared: bool,
    /// Whether grants carry a fencing token the protected resource checks; a fenced
    /// class needs no lock-delay.
    pub fenced: bool,
    /// Whether waiters are granted in arrival order rather than whoever retries first.
    pub fair: bool,
    /// For unfenced classes: how long a lock whose holder vanished without releasing
    /// stays ungranted, so a holder that does not know it lost the lock stops first.
    pub lock_delay: Duration,
}

impl LockClass {
    /// The default class the proxy uses without a file: the most permissive rules, so
    /// that running without classes changes nothing for clients.
    fn builtin_default(ttl_min: Duration, ttl_max: Duration) -> LockClass {
        LockClass {
            name: "default".to_owned(),
            prefix: String::new(),
            ttl_min,
            ttl_max,
            exclusive: true,
            shared: true,
            fenced: true,
            fair: false,
            lock_delay: Duration::ZERO,
        }
    }

    /// Refuses a mode the class does not allow, with a reason the client can act on.
    pub fn check_mode(&self, lock: &str, shared: bool) -> Result<(), String> {
        let (allowed, only) = if shared {
            (self.shared, "exclusive")
        } else {
            (self.exclusive, "shared")
        };
        if allowed {
            return Ok(());
        }
        Err(format!(
            "lock {lock:?} (class {}) allows only {only} mode",
            self.name
        ))
    }

    /// Refuses a session whose TTL is outside the class's bounds, naming both, so the
    /// client knows which TTL to open its session with.
    pub fn check_ttl(&self, lock: &str, ttl: Duration) -> Result<(), String> {
        if (self.ttl_min..=self.ttl_max).contains(&ttl) {
            return Ok(());
        }
        Err(format!(
            "session TTL {} is outside class {}'s bounds {}..{} for lock {lock:?}",
            show(ttl),
            self.name,
            show(self.ttl_min),
            show(self.ttl_max)
        ))
    }
}

/// One complete, validated set of classes. Immutable: a reload builds a new one.
#[derive(Debug, Clone, PartialEq)]
pub struct Classes {
    default: LockClass,
    /// Longest prefix first, so the first match is the longest. Prefixes are unique,
    /// and two different prefixes of the same length cannot both match one name, so
    /// the order among equal lengths does not matter.
    classes: Vec<LockClass>,
}

impl Classes {
    /// Parses and validates a classes file; `file` is only used in error messages.
    pub fn parse(text: &str, file: &Path) -> Result<Classes, ClassesError> {
        loader::parse(text, file)
    }

    /// What the proxy uses without a classes file: one default class allowing both
    /// modes, fenced, not fair, no delay, TTL bounds as given (the proxy's flags).
    pub fn builtin(ttl_min: Duration, ttl_max: Duration) -> Classes {
        Classes::new(LockClass::builtin_default(ttl_min, ttl_max), Vec::new())
    }

    fn new(default: LockClass, mut classes: Vec<LockClass>) -> Classes {
        classes.sort_by_key(|c| std::cmp::Reverse(c.prefix.len()));
        Classes { default, classes }
    }

    /// The class for `lock` (longest matching prefix, else the default). A linear scan:
    /// a cell declares a handful of classes, and this runs once per acquire.
    pub fn class_for(&self, lock: &str) -> &LockClass {
        self.classes
            .iter()
            .find(|c| lock.starts_with(c.prefix.as_str()))
            .unwrap_or(&self.default)
    }

    /// The class for names no prefix matches.
    pub fn default_class(&self) -> &LockClass {
        &self.default
    }

    /// Every class, the default first, then longest prefix first (for logs and the
    /// admin page).
    pub fn iter(&self) -> impl Iterator<Item = &LockClass> {
        std::iter::once(&self.default).chain(&self.classes)
    }

    /// The longest lock_delay of any class (a restarted proxy waits this long before
    /// granting delayed locks, since it forgot which holders vanished).
    pub fn max_lock_delay(&self) -> Duration {
        self.iter().map(|c| c.lock_delay).max().unwrap_or_default()
    }
}

/// Durations in messages are written the way the file writes them ("15s", "1s 500ms").
fn show(d: Duration) -> humantime::FormattedDuration {
    humantime::format_duration(d)
}

/// The lock classes in force: the last good classes file (see [`crate::declared`]).
pub type ClassBook = crate::declared::Book<Classes>;

/// Why a classes file was refused.
pub type ClassesError = crate::declared::FileError;

impl crate::declared::Declared for Classes {
    const WHAT: &'static str = "lock classes";
    const RELOADS: &'static str = crate::metrics::CLASSES_RELOADS;
    const RELOAD_FAILURES: &'static str = crate::metrics::CLASSES_RELOAD_FAILURES;

    fn parse(text: &str, file: &Path) -> Result<Self, FileError> {
        loader::parse(text, file)
    }

    fn count(&self) -> usize {
        self.classes.len()
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::sync::Arc;

    use tokio::signal::unix::{signal, SignalKind};
    use tokio::sync::watch;

    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn classes(text: &str) -> Classes {
        Classes::parse(text, Path::new("t.toml")).unwrap()
    }

    const NESTED: &str = r#"
[[class]]
name = "a"
prefix = "a/"
[[class]]
name = "ab"
prefix = "a/b/"
"#;

    #[test]
    fn the_longest_matching_prefix_wins() {
        let c = classes(NESTED);
        assert_eq!(c.class_for("a/b/c").name, "ab");
        assert_eq!(c.class_for("a/bc").name, "a");
        assert_eq!(c.class_for("a/b").name, "a");
        assert_eq!(c.class_for("x").name, "default");
        assert_eq!(c.class_for("a").name, "default");
        let names: Vec<_> = c.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["default", "ab", "a"]);
    }

    #[test]
    fn builtin_is_one_permissive_default_class() {
        let c = Classes::builtin(secs(2), secs(30));
        let d = c.class_for("anything/at/all");
        assert_eq!((d.name.as_str(), d.prefix.as_str()), ("default", ""));
        assert_eq!((d.ttl_min, d.ttl_max), (secs(2), secs(30)));
        assert!(d.exclusive && d.shared && d.fenced && !d.fair);
        assert_eq!(c.max_lock_delay(), Duration::ZERO);
        assert_eq!(c.iter().count(), 1);
    }

    #[test]
    fn check_mode_names_the_lock_the_class_and_the_rule() {
        let c = classes("[[class]]\nname = \"batch\"\nprefix = \"batch/\"\nmodes = [\"exclusive\"]\n[[class]]\nname = \"cfg\"\nprefix = \"cfg/\"\nmodes = [\"shared\"]");
        let batch = c.class_for("batch/x");
        assert_eq!(batch.check_mode("batch/x", false), Ok(()));
        assert_eq!(
            batch.check_mode("batch/x", true).unwrap_err(),
            "lock \"batch/x\" (class batch) allows only exclusive mode"
        );
        assert_eq!(
            c.class_for("cfg/y").check_mode("cfg/y", false).unwrap_err(),
            "lock \"cfg/y\" (class cfg) allows only shared mode"
        );
        assert_eq!(c.class_for("z").check_mode("z", true), Ok(()));
    }

    #[test]
    fn check_ttl_names_the_bounds_and_the_lock() {
        let c = classes(
            "[[class]]\nname = \"batch\"\nprefix = \"batch/\"\nttl_min = \"5s\"\nttl_max = \"60s\"",
        );
        let batch = c.class_for("batch/x");
        assert_eq!(batch.check_ttl("batch/x", secs(5)), Ok(()));
        assert_eq!(batch.check_ttl("batch/x", secs(60)), Ok(()));
        assert_eq!(
            batch.check_ttl("batch/x", secs(2)).unwrap_err(),
            "session TTL 2s is outside class batch's bounds 5s..1m for lock \"batch/x\""
        );
        assert!(batch.check_ttl("batch/x", secs(61)).is_err());
    }

    const GOOD_A: &str = "[[class]]\nname = \"a\"\nprefix = \"a/\"\n";
    const GOOD_B: &str = "[[class]]\nname = \"b\"\nprefix = \"b/\"\nfair = true\n";

    fn book_on(text: &str) -> (tempfile::TempDir, PathBuf, Arc<ClassBook>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("classes.toml");
        std::fs::write(&path, text).unwrap();
        let book = ClassBook::load(Some(path.clone()), Classes::builtin(secs(1), secs(9))).unwrap();
        (dir, path, Arc::new(book))
    }

    #[test]
    fn load_uses_the_fallback_without_a_file_and_refuses_a_missing_or_bad_one() {
        let fallback = Classes::builtin(secs(3), secs(9));
        let book = ClassBook::load(None, fallback.clone()).unwrap();
        assert_eq!(*book.current(), fallback);
        assert!(matches!(book.reload(), Ok(false)));

        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.toml");
        let e = ClassBook::load(Some(missing.clone()), fallback.clone())
            .err()
            .unwrap();
        assert_eq!(e.file, missing);
        assert_eq!(e.line, None);
        assert!(e.message.contains("cannot read"), "{e}");
        assert!(e
            .to_string()
            .starts_with(&format!("{}: cannot read", missing.display())));

        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, "[[class]]\nname = \"x\"\n").unwrap();
        let e = ClassBook::load(Some(bad), fallback).err().unwrap();
        assert_eq!(e.line, Some(1), "{e}");
    }

    #[test]
    fn reload_refuses_a_bad_file_and_keeps_the_last_good_one() {
        let (_dir, path, book) = book_on(GOOD_A);
        let before = book.current();
        assert_eq!(before.class_for("a/1").name, "a");
        assert!(
            matches!(book.reload(), Ok(false)),
            "same content is no change"
        );

        std::fs::write(&path, format!("{GOOD_A}modes = []\n")).unwrap();
        let e = book.reload().unwrap_err();
        assert_eq!(e.line, Some(4), "{e}");
        assert!(Arc::ptr_eq(&before, &book.current()));

        std::fs::remove_file(&path).unwrap();
        assert!(book.reload().is_err());
        assert!(Arc::ptr_eq(&before, &book.current()));

        std::fs::write(&path, GOOD_B).unwrap();
        assert!(matches!(book.reload(), Ok(true)));
        let after = book.current();
        assert_eq!(after.class_for("a/1").name, "default");
        assert!(after.class_for("b/1").fair);
        assert!(matches!(book.reload(), Ok(false)));
    }

    /// Waits, with a deadline, until the classes in force give `lock` the class `name`.
    async fn until_class(book: &ClassBook, lock: &str, name: &str, nudge: impl Fn()) {
        let waited = tokio::time::timeout(Duration::from_secs(10), async {
            while book.current().class_for(lock).name != name {
                nudge();
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(waited.is_ok(), "{lock} never got class {name}");
    }

    #[tokio::test]
    async fn follow_picks_up_a_changed_file_and_stops_on_shutdown() {
        let (_dir, path, book) = book_on(GOOD_A);
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(book.clone().follow(Duration::from_millis(10), stopped));
        std::fs::write(&path, GOOD_B).unwrap();
        until_class(&book, "b/1", "b", || {}).await;
        // A bad file on the way does not stop the following.
        std::fs::write(&path, "[[class]]\n").unwrap();
        std::fs::write(
            &path,
            format!("{GOOD_A}\n[[class]]\nname = \"c\"\nprefix = \"c/\"\n"),
        )
        .unwrap();
        until_class(&book, "c/1", "c", || {}).await;
        stop.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("follow stops on shutdown")
            .unwrap();
    }

    #[tokio::test]
    async fn follow_reloads_on_sighup() {
        // Listening first replaces SIGHUP's default action (exit) for this process
        // before any is sent.
        let _listening = signal(SignalKind::hangup()).unwrap();
        let (_dir, path, book) = book_on(GOOD_A);
        let (_stop, stopped) = watch::channel(false);
        // A poll this long never fires during the test: only SIGHUP can reload.
        let task = tokio::spawn(book.clone().follow(Duration::from_secs(3600), stopped));
        std::fs::write(&path, GOOD_B).unwrap();
        let pid = std::process::id().to_string();
        // follow may not listen yet when the first signal arrives, so keep sending.
        until_class(&book, "b/1", "b", || {
            let sent = std::process::Command::new("kill")
                .args(["-HUP", &pid])
                .status();
            assert!(sent.unwrap().success());
        })
        .await;
        task.abort();
    }
}
