use clap::{Args, CommandFactory, Subcommand};

use super::*;

/// A binary shaped like lockcell-cell and lockctl: globals, commands, a command of
/// commands, positionals and a command to run after `--`.
#[derive(Debug, Parser)]
#[command(name = "demo")]
struct Demo {
    /// The file.
    #[arg(long, env = "DEMO_SETTINGS_CONFIG", global = true)]
    config: Option<PathBuf>,
    #[arg(long, global = true)]
    print_config: bool,
    /// Where to connect.
    #[arg(long, global = true, default_value = "127.0.0.1:1")]
    proxy: String,
    #[command(subcommand)]
    command: Sub,
}

#[derive(Debug, Subcommand)]
enum Sub {
    Run(RunArgs),
    Serve(ServeArgs),
    Map {
        #[command(subcommand)]
        command: MapCommand,
    },
}

#[derive(Debug, Subcommand)]
enum MapCommand {
    Move(MoveArgs),
}

#[derive(Debug, Args)]
struct Etcd {
    /// Endpoints.
    #[arg(long, value_delimiter = ',', default_value = "e:1")]
    etcd: Vec<String>,
    /// A password.
    #[arg(long, env = "DEMO_SETTINGS_PASSWORD")]
    etcd_password: Option<String>,
}

#[derive(Debug, Args)]
struct RunArgs {
    #[command(flatten)]
    etcd: Etcd,
    name: String,
    #[arg(last = true)]
    command: Vec<String>,
}

#[derive(Debug, Args)]
struct ServeArgs {
    #[command(flatten)]
    etcd: Etcd,
    #[arg(long, default_value = "1s")]
    timeout: String,
    #[arg(long, requires = "key")]
    cert: Option<String>,
    #[arg(long, requires = "cert")]
    key: Option<String>,
    #[arg(long)]
    verbose: bool,
}

#[derive(Debug, Args)]
struct MoveArgs {
    #[command(flatten)]
    etcd: Etcd,
    #[arg(long)]
    to: String,
    prefix: String,
}

fn args(list: &[&str]) -> Vec<OsString> {
    std::iter::once("demo")
        .chain(list.iter().copied())
        .map(OsString::from)
        .collect()
}

fn file(text: &str) -> tempfile::NamedTempFile {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), text).unwrap();
    file
}

fn load_with(text: &str, list: &[&str]) -> Result<Loaded<Demo>, String> {
    let f = file(text);
    let mut all = vec!["--config", f.path().to_str().unwrap()];
    all.extend_from_slice(list);
    load::<Demo>(args(&all)).map_err(|e| e.to_string())
}

const FILE: &str = "\
proxy = \"10.0.0.7:7420\"
etcd = [\"http://a:2379\", \"http://b:2379\"]
timeout = \"3s\"

[serve]
etcd = [\"http://serve:2379\"]
verbose = true

[map.move]
to = \"cell-b\"
";

#[test]
fn a_top_level_setting_serves_every_command_and_a_table_wins_for_its_own() {
    let run = load_with(FILE, &["run", "job", "--", "sh", "--etcd", "x"])
        .unwrap()
        .config;
    assert_eq!(run.proxy, "10.0.0.7:7420");
    let Sub::Run(r) = run.command else {
        panic!("run")
    };
    assert_eq!(r.etcd.etcd, ["http://a:2379", "http://b:2379"]);
    assert_eq!(r.name, "job");
    assert_eq!(
        r.command,
        ["sh", "--etcd", "x"],
        "the file's settings stay out of the command after --"
    );

    let Sub::Serve(s) = load_with(FILE, &["serve"]).unwrap().config.command else {
        panic!("serve")
    };
    assert_eq!(s.etcd.etcd, ["http://serve:2379"], "[serve] wins");
    assert_eq!(s.timeout, "3s");
    assert!(s.verbose);

    let Sub::Map {
        command: MapCommand::Move(m),
    } = load_with(FILE, &["map", "move", "billing/"])
        .unwrap()
        .config
        .command
    else {
        panic!("map move")
    };
    assert_eq!(m.to, "cell-b");
    assert_eq!(m.prefix, "billing/");
    assert_eq!(m.etcd.etcd, ["http://a:2379", "http://b:2379"]);
}

#[test]
fn a_flag_beats_the_file_wherever_it_is_given() {
    // The global's value is the name of a command: the settings still go after `run`.
    let loaded = load_with(
        FILE,
        &["--proxy", "run", "run", "--etcd", "http://flag:1", "j"],
    )
    .unwrap();
    assert_eq!(loaded.config.proxy, "run");
    let Sub::Run(r) = &loaded.config.command else {
        panic!("run")
    };
    assert_eq!(r.etcd.etcd, ["http://flag:1"]);
    let shown = loaded.render();
    assert!(
        shown
            .lines()
            .any(|l| l.starts_with("etcd = [\"http://flag:1\"]") && l.ends_with("# flag")),
        "{shown}"
    );
    // A global given after the command.
    let loaded = load_with(FILE, &["serve", "--proxy", "p:2"]).unwrap();
    assert_eq!(loaded.config.proxy, "p:2");
}

#[test]
fn the_environment_beats_the_file() {
    let f = file("etcd-password = \"from-file\"\n");
    // Only this test sets the variable.
    std::env::set_var("DEMO_SETTINGS_PASSWORD", "from-env");
    let loaded = load::<Demo>(args(&["--config", f.path().to_str().unwrap(), "serve"]));
    std::env::remove_var("DEMO_SETTINGS_PASSWORD");
    let loaded = loaded.unwrap();
    let Sub::Serve(s) = &loaded.config.command else {
        panic!("serve")
    };
    assert_eq!(s.etcd.etcd_password.as_deref(), Some("from-env"));
    let shown = loaded.render();
    assert!(
        shown.contains("etcd-password = \"(hidden)\"")
            && shown.contains("environment DEMO_SETTINGS_PASSWORD")
            && !shown.contains("from-env"),
        "{shown}"
    );
}

#[test]
fn print_config_shows_each_command_as_its_table() {
    let loaded = load_with(FILE, &["serve", "--timeout", "9s"]).unwrap();
    let shown = loaded.render();
    let (root, serve) = shown.split_once("\n[serve]\n").expect(&shown);
    assert!(
        root.lines()
            .any(|l| l.starts_with("proxy = \"10.0.0.7:7420\"") && l.ends_with("# file")),
        "{shown}"
    );
    assert!(
        serve
            .lines()
            .any(|l| l.starts_with("timeout = \"9s\"") && l.ends_with("# flag")),
        "{shown}"
    );
    assert!(
        serve
            .lines()
            .any(|l| l.starts_with("verbose = true") && l.ends_with("# file")),
        "{shown}"
    );
    assert!(
        serve.contains("# cert ="),
        "an unset setting shows: {shown}"
    );
    // What it prints loads back to the same configuration.
    let text: String = shown
        .lines()
        .map(|l| l.split("  #").next().unwrap_or_default().trim_end())
        .collect::<Vec<_>>()
        .join("\n");
    let again = load_with(&text, &["serve"]).unwrap();
    let Sub::Serve(s) = again.config.command else {
        panic!("serve")
    };
    assert_eq!(s.timeout, "9s");
    assert_eq!(s.etcd.etcd, ["http://serve:2379"]);
}

#[test]
fn a_bad_file_is_refused_naming_the_setting_and_the_table() {
    let e = load_with("etcd-pasword = \"x\"\n", &["serve"])
        .err()
        .unwrap();
    assert!(
        e.contains("unknown setting \"etcd-pasword\"") && e.contains("demo --help"),
        "{e}"
    );
    let e = load_with("[serve]\nto = \"b\"\n", &["serve"])
        .err()
        .unwrap();
    assert!(
        e.contains("unknown setting \"to\" in [serve]") && e.contains("demo serve --help"),
        "{e}"
    );
    // A setting of another command is not refused; a table of another command is
    // checked even when that command does not run.
    load_with("to = \"b\"\n", &["serve"]).unwrap();
    let e = load_with("[map.move]\nverbose = true\n", &["serve"])
        .err()
        .unwrap();
    assert!(e.contains("\"verbose\" in [map.move]"), "{e}");
    let e = load_with("timeout = \"soon\"\nverbose = 3\n", &["serve"])
        .err()
        .unwrap();
    assert!(e.contains("verbose") && e.contains("true or false"), "{e}");
    let e = load_with("[serve]\ncert = \"c.pem\"\n", &["serve"])
        .err()
        .unwrap();
    assert!(
        e.contains("configuration file") && e.contains("--key"),
        "a rule between settings holds for the file: {e}"
    );
    load_with("[serve]\ncert = \"c.pem\"\n", &["serve", "--key", "k.pem"]).unwrap();
}

#[test]
fn a_broken_file_never_quotes_its_line() {
    let e = load_with("etcd-password = \"hunter2\n", &["serve"])
        .err()
        .unwrap();
    assert!(
        e.contains("not TOML (line 1)") && !e.contains("hunter2"),
        "{e}"
    );
}

#[test]
fn the_reference_names_every_command_and_setting() {
    let doc = reference(&Demo::command());
    assert!(doc.starts_with("## demo\n"), "{doc}");
    assert!(doc.contains("`DEMO_SETTINGS_CONFIG`"), "{doc}");
    assert!(doc.contains("| `proxy` (every command) |"), "{doc}");
    assert!(doc.contains("### `serve` (file table `[serve]`)"), "{doc}");
    assert!(
        doc.contains("### `map move` (file table `[map.move]`)"),
        "{doc}"
    );
    assert!(doc.contains("| `timeout` |  | `1s` |"), "{doc}");
    assert!(!doc.contains("print-config` |"), "{doc}");
}

#[test]
fn a_urls_credentials_never_show() {
    assert_eq!(
        hide_credentials("http://bob:hunter2@ch:8123/?database=x&password=hunter2#f"),
        "http://bob:(hidden)@ch:8123/?database=x&password=(hidden)#f"
    );
    assert_eq!(hide_credentials("s3://bucket/prefix"), "s3://bucket/prefix");
    assert_eq!(hide_credentials("/var/lib/audit.db"), "/var/lib/audit.db");
    let loaded = load_with(
        "[serve]\ncert = \"http://bob:hunter2@ch:8123/?Password=hunter2\"\nkey = \"k\"\n",
        &["serve"],
    )
    .unwrap();
    let shown = loaded.render();
    assert!(!shown.contains("hunter2"), "{shown}");
}

#[test]
fn a_mistake_in_the_arguments_is_not_blamed_on_the_file() {
    let e = load_with(FILE, &["serve", "--bogus"]).err().unwrap();
    assert!(
        e.contains("--bogus") && !e.contains("configuration file"),
        "{e}"
    );
    // One the file makes is.
    let e = load_with("[serve]\ncert = \"c.pem\"\n", &["serve"])
        .err()
        .unwrap();
    assert!(e.contains("configuration file"), "{e}");
    assert_eq!(
        e.matches("For more information").count(),
        1,
        "clap's help line is not repeated: {e}"
    );
}

#[test]
fn a_broken_files_line_is_the_line_of_the_mistake() {
    let e = load_with(
        "proxy = \"a\"\ntimeout = \"1s\"\nproxy = \"b\"\n",
        &["serve"],
    )
    .err()
    .unwrap();
    assert!(e.contains("(line 3)"), "{e}");
}
