//! Turns the text of a classes file into [`Classes`]: the TOML layout, how a class
//! inherits from `[default]`, and every rule a file must meet, each refusal pointing
//! at the line to fix.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

use super::{show, Classes, ClassesError, LockClass};

/// Shortest session TTL a class may allow: a session renews several times per TTL, so
/// below this its keepalives would flood the proxy and any pause would expire it.
pub const TTL_FLOOR: Duration = Duration::from_millis(100);

/// The `[default]` values a file that does not set them gets; the same as the proxy's
/// `--session-ttl-min`/`--session-ttl-max` defaults.
const FILE_TTL_MIN: Duration = Duration::from_secs(1);
const FILE_TTL_MAX: Duration = Duration::from_secs(120);

/// The file as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    default: Option<Spanned<RawClass>>,
    #[serde(default)]
    class: Vec<Spanned<RawClass>>,
}

/// One `[default]` or `[[class]]` table. Every field is optional here so a missing
/// `name` is reported with its table's line, and `[default]` shares the shape so a
/// `name` or `prefix` there gets an explanation rather than "unknown field".
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClass {
    name: Option<Spanned<String>>,
    prefix: Option<Spanned<String>>,
    ttl_min: Option<Spanned<String>>,
    ttl_max: Option<Spanned<String>>,
    modes: Option<Spanned<Vec<String>>>,
    fenced: Option<Spanned<bool>>,
    fair: Option<Spanned<bool>>,
    lock_delay: Option<Spanned<String>>,
}

pub(super) fn parse(text: &str, file: &Path) -> Result<Classes, ClassesError> {
    let src = Source { text, file };
    let raw: RawFile =
        toml::from_str(text).map_err(|e| src.error(e.span(), e.message().trim_end()))?;
    let builtin = LockClass::builtin_default(FILE_TTL_MIN, FILE_TTL_MAX);
    let default = match &raw.default {
        Some(table) => src.default_class(table, &builtin)?,
        None => builtin,
    };
    let mut names: HashMap<String, usize> = HashMap::new();
    let mut prefixes: HashMap<String, (String, usize)> = HashMap::new();
    let mut classes = Vec::with_capacity(raw.class.len());
    for (index, table) in raw.class.iter().enumerate() {
        let class = src.class(index + 1, table, &default, &names, &prefixes)?;
        let line = src.line(table.span());
        names.insert(class.name.clone(), line);
        prefixes.insert(class.prefix.clone(), (class.name.clone(), line));
        classes.push(class);
    }
    Ok(Classes::new(default, classes))
}

/// The text being parsed, to turn byte spans into the lines an operator can find.
struct Source<'a> {
    text: &'a str,
    file: &'a Path,
}

impl Source<'_> {
    fn line(&self, span: Range<usize>) -> usize {
        let end = span.start.min(self.text.len());
        1 + self.text.as_bytes()[..end]
            .iter()
            .filter(|&&b| b == b'\n')
            .count()
    }

    fn error(&self, span: Option<Range<usize>>, message: impl Into<String>) -> ClassesError {
        ClassesError {
            file: self.file.to_owned(),
            line: span.map(|s| self.line(s)),
            message: message.into(),
        }
    }

    fn default_class(
        &self,
        table: &Spanned<RawClass>,
        builtin: &LockClass,
    ) -> Result<LockClass, ClassesError> {
        let raw = table.get_ref();
        if let Some(name) = &raw.name {
            return Err(self.error(
                Some(name.span()),
                "[default]: name is not allowed here: the default class is always named \"default\"",
            ));
        }
        if let Some(prefix) = &raw.prefix {
            return Err(self.error(
                Some(prefix.span()),
                "[default]: prefix is not allowed here: the default class covers every lock no class's prefix matches",
            ));
        }
        self.policy("[default]", table, builtin, "built in", "default", "")
    }

    fn class(
        &self,
        number: usize,
        table: &Spanned<RawClass>,
        default: &LockClass,
        names: &HashMap<String, usize>,
        prefixes: &HashMap<String, (String, usize)>,
    ) -> Result<LockClass, ClassesError> {
        let raw = table.get_ref();
        let Some(name) = &raw.name else {
            return Err(self.error(
                Some(table.span()),
                format!("[[class]] number {number}: name is required"),
            ));
        };
        let at = Some(name.span());
        let name = name.get_ref();
        if name.is_empty()
            || !name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
        {
            return Err(self.error(
                at,
                format!("[[class]] number {number}: name {name:?} may use only a-z, 0-9, _ and -"),
            ));
        }
        if name == "default" {
            return Err(self.error(
                at,
                "class name \"default\" is reserved for the [default] table",
            ));
        }
        if let Some(line) = names.get(name) {
            return Err(self.error(
                at,
                format!("class name {name:?} is already used by the class on line {line}"),
            ));
        }
        let who = format!("class {name}");
        let Some(prefix) = &raw.prefix else {
            return Err(self.error(Some(table.span()), format!("{who}: prefix is required")));
        };
        let at = Some(prefix.span());
        let prefix = prefix.get_ref();
        let problem = if prefix.is_empty() {
            Some("must not be empty: the [default] table covers every lock no class matches")
        } else if prefix.starts_with('/') {
            Some("must not start with \"/\": lock names never do")
        } else if prefix.contains('!') {
            Some("must not contain \"!\": it is reserved by lockcell's key layout")
        } else if prefix.chars().any(char::is_control) {
            Some("must not contain control characters")
        } else {
            None
        };
        if let Some(problem) = problem {
            return Err(self.error(at, format!("{who}: prefix {prefix:?} {problem}")));
        }
        if let Some((other, line)) = prefixes.get(prefix) {
            return Err(self.error(
                at,
                format!("{who}: prefix {prefix:?} is already the prefix of class {other} on line {line}"),
            ));
        }
        self.policy(&who, table, default, "from [default]", name, prefix)
    }

    /// A class's session TTL bounds, as set or inherited from `base` (`inherited`
    /// says from where): the least at least [`TTL_FLOOR`], and no more than the most.
    fn ttls(
        &self,
        who: &str,
        table: &Spanned<RawClass>,
        base: &LockClass,
        inherited: &str,
    ) -> Result<(Duration, Duration), ClassesError> {
        let raw = table.get_ref();
        let here = |span: Option<Range<usize>>| Some(span.unwrap_or_else(|| table.span()));
        let origin = |set: bool| {
            if set {
                String::new()
            } else {
                format!(", {inherited}")
            }
        };
        let ttl_min = self.duration(who, "ttl_min", &raw.ttl_min)?;
        let ttl_max = self.duration(who, "ttl_max", &raw.ttl_max)?;
        let min_span = raw.ttl_min.as_ref().map(Spanned::span);
        let max_span = raw.ttl_max.as_ref().map(Spanned::span);
        let (min, max) = (
            ttl_min.unwrap_or(base.ttl_min),
            ttl_max.unwrap_or(base.ttl_max),
        );
        if min < TTL_FLOOR {
            return Err(self.error(
                here(min_span),
                format!("{who}: ttl_min ({}) is below {}: sessions that short would expire at the first pause", show(min), show(TTL_FLOOR)),
            ));
        }
        if min > max {
            return Err(self.error(
                here(min_span.or(max_span)),
                format!(
                    "{who}: ttl_min ({}{}) is above ttl_max ({}{})",
                    show(min),
                    origin(ttl_min.is_some()),
                    show(max),
                    origin(ttl_max.is_some())
                ),
            ));
        }
        Ok((min, max))
    }

    /// Resolves the policy fields of one table over `base`; `inherited` says where
    /// base values come from, for messages about them.
    fn policy(
        &self,
        who: &str,
        table: &Spanned<RawClass>,
        base: &LockClass,
        inherited: &str,
        name: &str,
        prefix: &str,
    ) -> Result<LockClass, ClassesError> {
        let raw = table.get_ref();
        let here = |span: Option<Range<usize>>| Some(span.unwrap_or_else(|| table.span()));
        let (min, max) = self.ttls(who, table, base, inherited)?;
        let (exclusive, shared) = match &raw.modes {
            None => (base.exclusive, base.shared),
            Some(modes) => self.modes(who, modes)?,
        };
        let fenced = raw.fenced.as_ref().map_or(base.fenced, |f| *f.get_ref());
        let fair = raw.fair.as_ref().map_or(base.fair, |f| *f.get_ref());
        // A fenced class has no lock-delay, so it does not inherit one.
        let lock_delay = match self.duration(who, "lock_delay", &raw.lock_delay)? {
            Some(delay) => delay,
            None if fenced => Duration::ZERO,
            None => base.lock_delay,
        };
        if fenced && !lock_delay.is_zero() {
            let hint = if raw.fenced.is_some() {
                String::new()
            } else {
                format!(" (fenced = true is {inherited}; set fenced = false to use a lock-delay)")
            };
            return Err(self.error(
                here(raw.lock_delay.as_ref().map(Spanned::span)),
                format!("{who}: lock_delay must be 0s on a fenced class: fencing already protects against a late holder{hint}"),
            ));
        }
        Ok(LockClass {
            name: name.to_owned(),
            prefix: prefix.to_owned(),
            ttl_min: min,
            ttl_max: max,
            exclusive,
            shared,
            fenced,
            fair,
            lock_delay,
        })
    }

    fn duration(
        &self,
        who: &str,
        field: &str,
        value: &Option<Spanned<String>>,
    ) -> Result<Option<Duration>, ClassesError> {
        let Some(value) = value else {
            return Ok(None);
        };
        humantime::parse_duration(value.get_ref())
            .map(Some)
            .map_err(|e| {
                self.error(
                    Some(value.span()),
                    format!("{who}: {field} {:?} is not a duration ({e}); write e.g. \"15s\" or \"500ms\"", value.get_ref()),
                )
            })
    }

    /// `(exclusive, shared)` from a `modes` list.
    fn modes(&self, who: &str, modes: &Spanned<Vec<String>>) -> Result<(bool, bool), ClassesError> {
        let at = Some(modes.span());
        if modes.get_ref().is_empty() {
            return Err(self.error(
                at,
                format!("{who}: modes is empty: allow \"exclusive\", \"shared\" or both"),
            ));
        }
        let (mut exclusive, mut shared) = (false, false);
        for mode in modes.get_ref() {
            let seen = match mode.as_str() {
                "exclusive" => &mut exclusive,
                "shared" => &mut shared,
                other => {
                    return Err(self.error(
                        at,
                        format!("{who}: modes: unknown mode {other:?} (the modes are \"exclusive\" and \"shared\")"),
                    ))
                }
            };
            if *seen {
                return Err(self.error(at, format!("{who}: modes lists {mode:?} twice")));
            }
            *seen = true;
        }
        Ok((exclusive, shared))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = include_str!("../../../deploy/config/classes.toml");

    fn parse(text: &str) -> Result<Classes, ClassesError> {
        Classes::parse(text, Path::new("conf/classes.toml"))
    }

    fn refusal(text: &str) -> String {
        match parse(text) {
            Ok(classes) => panic!("accepted {text:?} as {classes:?}"),
            Err(e) => e.to_string(),
        }
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn parses_the_example_file() {
        let classes = Classes::parse(EXAMPLE, Path::new("deploy/config/classes.toml"))
            .unwrap_or_else(|e| panic!("the example file is refused: {e}"));
        assert_eq!(
            classes.default_class(),
            &Classes::builtin(secs(1), secs(120)).default
        );
        let batch = classes.class_for("batch/reindex");
        assert_eq!(
            batch,
            &LockClass {
                name: "batch".into(),
                prefix: "batch/".into(),
                ttl_min: secs(5),
                ttl_max: secs(60),
                exclusive: true,
                shared: false,
                fenced: false,
                fair: true,
                lock_delay: secs(15),
            }
        );
        // A nested prefix is its own class: it inherits from [default], not from batch.
        let nightly = classes.class_for("batch/nightly/compact");
        assert_eq!(nightly.name, "nightly");
        assert!(nightly.fenced && nightly.shared && !nightly.fair);
        assert_eq!(classes.class_for("election/db").name, "leader");
        assert_eq!(classes.class_for("election/db").ttl_max, secs(30));
        assert!(classes.class_for("config/app").fair);
        assert_eq!(classes.class_for("other").name, "default");
        assert_eq!(classes.max_lock_delay(), secs(15));
    }

    #[test]
    fn an_empty_file_is_the_builtin_default() {
        assert_eq!(parse("").unwrap(), Classes::builtin(secs(1), secs(120)));
        assert_eq!(parse("# nothing yet\n").unwrap().iter().count(), 1);
    }

    #[test]
    fn classes_inherit_the_files_default_table() {
        let classes = parse(
            r#"
[default]
ttl_max = "30s"
modes = ["exclusive"]
fenced = false
fair = true
lock_delay = "10s"

[[class]]
name = "plain"
prefix = "p/"

[[class]]
name = "fenced"
prefix = "f/"
fenced = true

[[class]]
name = "own"
prefix = "o/"
ttl_min = "2s"
modes = ["shared", "exclusive"]
fair = false
lock_delay = "3s"
"#,
        )
        .unwrap();
        let plain = classes.class_for("p/x");
        assert_eq!((plain.ttl_min, plain.ttl_max), (secs(1), secs(30)));
        assert!(plain.exclusive && !plain.shared && !plain.fenced && plain.fair);
        assert_eq!(plain.lock_delay, secs(10));
        let fenced = classes.class_for("f/x");
        assert!(fenced.fenced);
        assert_eq!(
            fenced.lock_delay,
            Duration::ZERO,
            "a fenced class has no lock-delay"
        );
        let own = classes.class_for("o/x");
        assert_eq!((own.ttl_min, own.ttl_max), (secs(2), secs(30)));
        assert!(own.exclusive && own.shared && !own.fair);
        assert_eq!(own.lock_delay, secs(3));
        assert_eq!(classes.max_lock_delay(), secs(10));
    }

    #[test]
    fn every_rule_is_refused_naming_file_line_and_field() {
        let class = |body: &str| format!("[[class]]\nname = \"b\"\nprefix = \"b/\"\n{body}\n");
        let cases: Vec<(String, &str)> = vec![
            // TTL bounds.
            (class("ttl_min = \"10s\"\nttl_max = \"5s\""), ":4: class b: ttl_min (10s) is above ttl_max (5s)"),
            (class("ttl_min = \"200s\""), ":4: class b: ttl_min (3m 20s) is above ttl_max (2m, from [default])"),
            ("[default]\nttl_max = \"500ms\"".into(), ":2: [default]: ttl_min (1s, built in) is above ttl_max (500ms)"),
            (class("ttl_min = \"50ms\""), ":4: class b: ttl_min (50ms) is below 100ms"),
            (class("ttl_max = \"soon\""), ":4: class b: ttl_max \"soon\" is not a duration"),
            // Modes.
            (class("modes = []"), ":4: class b: modes is empty"),
            (class("modes = [\"exclusive\", \"read\"]"), ":4: class b: modes: unknown mode \"read\""),
            (class("modes = [\"shared\", \"shared\"]"), ":4: class b: modes lists \"shared\" twice"),
            // Fencing and lock-delay.
            (class("fenced = true\nlock_delay = \"5s\""), ":5: class b: lock_delay must be 0s on a fenced class: fencing already protects against a late holder"),
            (class("lock_delay = \"5s\""), ":4: class b: lock_delay must be 0s on a fenced class: fencing already protects against a late holder (fenced = true is from [default]; set fenced = false"),
            ("[default]\nlock_delay = \"1s\"".into(), ":2: [default]: lock_delay must be 0s on a fenced class"),
            // Names.
            ("\n[[class]]\nprefix = \"x/\"".into(), ":2: [[class]] number 1: name is required"),
            ("[[class]]\nname = \"Batch\"\nprefix = \"x/\"".into(), ":2: [[class]] number 1: name \"Batch\" may use only a-z, 0-9, _ and -"),
            ("[[class]]\nname = \"\"\nprefix = \"x/\"".into(), ":2: [[class]] number 1: name \"\" may use only"),
            ("[[class]]\nname = \"default\"\nprefix = \"x/\"".into(), ":2: class name \"default\" is reserved"),
            (format!("{}\n[[class]]\nname = \"b\"\nprefix = \"c/\"", class("")), ":7: class name \"b\" is already used by the class on line 1"),
            ("[default]\nname = \"d\"".into(), ":2: [default]: name is not allowed here"),
            // Prefixes.
            ("[[class]]\nname = \"b\"".into(), ":1: class b: prefix is required"),
            ("[[class]]\nname = \"b\"\nprefix = \"\"".into(), ":3: class b: prefix \"\" must not be empty"),
            ("[[class]]\nname = \"b\"\nprefix = \"/b\"".into(), ":3: class b: prefix \"/b\" must not start with \"/\""),
            ("[[class]]\nname = \"b\"\nprefix = \"b!x\"".into(), ":3: class b: prefix \"b!x\" must not contain \"!\""),
            ("[[class]]\nname = \"b\"\nprefix = \"b\\tx\"".into(), ":3: class b: prefix \"b\\tx\" must not contain control characters"),
            (format!("{}\n[[class]]\nname = \"c\"\nprefix = \"b/\"", class("")), ":8: class c: prefix \"b/\" is already the prefix of class b on line 1"),
            ("[default]\nprefix = \"\"".into(), ":2: [default]: prefix is not allowed here"),
            // Unknown fields, wrong types, TOML syntax: toml's own message and line.
            (class("colour = \"red\""), ":4: unknown field `colour`"),
            ("[default]\nfair = false\nttl = \"1s\"".into(), ":3: unknown field `ttl`"),
            ("\n\n[classes]\nname = \"b\"".into(), ":3: unknown field `classes`"),
            (class("fair = \"yes\""), ":4: invalid type: string \"yes\", expected a boolean"),
            ("[[class]]\nname = \"b\"\nprefix = \"b/\n".into(), ":3: "),
        ];
        let wrong: Vec<String> = cases
            .iter()
            .filter_map(|(text, expected)| {
                let message = refusal(text);
                let expected = format!("conf/classes.toml{expected}");
                (!message.starts_with(&expected)).then(|| {
                    format!("for\n{text}\nexpected a message starting with\n  {expected}\ngot\n  {message}\n")
                })
            })
            .collect();
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    }
}
