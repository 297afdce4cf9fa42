//! The Kubernetes manifests: against the schemas (kubernetes-validate), the example
//! config files, and each other (zones, drain budgets, probes, disruption budgets).

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use serde::Deserialize;
use serde_json::Value;

use crate::systemd::{exec_start, setting};
use crate::{files, on_path, read, root};

/// The oldest Kubernetes the manifests are written for (native sidecars, Service
/// `trafficDistribution`); they are also checked against the newest the validator knows.
const OLDEST_KUBERNETES: &str = "1.31.0";

/// The proxy's drain flags and their defaults (`lockcell-proxy --help`).
const DRAIN_FLAGS: [(&str, &str); 3] = [
    ("--drain-timeout", "30s"),
    ("--shutdown-grace", "5s"),
    ("--lease-ttl", "12s"),
];

/// One document of a manifest file, and the file it came from.
pub(crate) struct Doc {
    file: String,
    value: Value,
}

impl Doc {
    pub(crate) fn kind(&self) -> &str {
        self.value["kind"].as_str().unwrap_or_default()
    }

    pub(crate) fn name(&self) -> String {
        let name = self.value["metadata"]["name"].as_str().unwrap_or("?");
        format!("{} {}/{name}", self.file, self.kind())
    }

    /// The pod spec of a workload.
    pub(crate) fn pod(&self) -> Option<&Value> {
        match self.kind() {
            "DaemonSet" | "Deployment" | "StatefulSet" | "Job" => {
                Some(&self.value["spec"]["template"]["spec"])
            }
            "CronJob" => Some(&self.value["spec"]["jobTemplate"]["spec"]["template"]["spec"]),
            _ => None,
        }
    }
}

/// The kustomization: which manifests make up the cell, and the lockcell image's name
/// and tag. Not a Kubernetes object: the schema validator does not know it.
const KUSTOMIZATION: &str = "kustomization.yaml";

/// The name the manifests give lockcell's image, which the kustomization replaces.
const IMAGE: &str = "lockcell";

/// The manifest files: every YAML file but the kustomization.
fn manifest_files() -> Result<Vec<PathBuf>> {
    Ok(files("deploy/kubernetes", "yaml")?
        .into_iter()
        .filter(|path| !path.ends_with(KUSTOMIZATION))
        .collect())
}

pub(crate) fn manifests() -> Result<Vec<Doc>> {
    let mut docs = Vec::new();
    for path in manifest_files()? {
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&path)?;
        for document in serde_yaml::Deserializer::from_str(&text) {
            let value = Value::deserialize(document).with_context(|| format!("parsing {file}"))?;
            if !value.is_null() {
                docs.push(Doc {
                    file: file.clone(),
                    value,
                });
            }
        }
    }
    Ok(docs)
}

pub(crate) fn containers(pod: &Value) -> impl Iterator<Item = &Value> {
    ["initContainers", "containers"]
        .into_iter()
        .flat_map(|list| pod[list].as_array().into_iter().flatten())
}

/// A container's command line: command, then args.
pub(crate) fn command_line(container: &Value) -> Vec<String> {
    ["command", "args"]
        .iter()
        .flat_map(|k| container[*k].as_array().into_iter().flatten())
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect()
}

fn runs(container: &Value, program: &str) -> bool {
    command_line(container).first().map(String::as_str) == Some(program)
}

/// The value of `--name=value` on a command line.
pub(crate) fn flag<'a>(line: &'a [String], name: &str) -> Option<&'a str> {
    line.iter()
        .find_map(|word| word.strip_prefix(name)?.strip_prefix('='))
}

/// What a stopping proxy may take: drain timeout + shutdown grace + lease TTL.
pub(crate) fn drain_budget(line: &[String]) -> Result<Duration> {
    let mut total = Duration::ZERO;
    for (name, default) in DRAIN_FLAGS {
        let value = flag(line, name).unwrap_or(default);
        total += humantime::parse_duration(value).with_context(|| format!("{name}={value}"))?;
    }
    Ok(total)
}

pub(crate) fn configmaps_hold_the_example_config_files() -> Result<()> {
    let docs = manifests()?;
    for (name, file) in [
        ("lockcell-classes", "classes.toml"),
        ("lockcell-grants", "grants.toml"),
    ] {
        let map = docs
            .iter()
            .find(|d| d.kind() == "ConfigMap" && d.value["metadata"]["name"] == name)
            .with_context(|| format!("no ConfigMap {name}"))?;
        let expected = read(&format!("deploy/config/{file}"))?;
        ensure!(
            map.value["data"][file].as_str() == Some(expected.as_str()),
            "{}: data.{file} differs from deploy/config/{file}; regenerate it (the file's comment says how)",
            map.name()
        );
    }
    Ok(())
}

pub(crate) fn every_zone_runs_the_same_proxy_daemonset() -> Result<()> {
    let docs = manifests()?;
    let mut seen = Vec::new();
    for doc in docs.iter().filter(|d| d.kind() == "DaemonSet") {
        let zone = doc.value["metadata"]["labels"]["lockcell/zone"]
            .as_str()
            .with_context(|| format!("{}: no lockcell/zone label", doc.name()))?;
        let text = doc.value.to_string().replace(zone, "ZONE");
        ensure!(
            text.contains("\"--zone=ZONE\""),
            "{}: --zone is not {zone}",
            doc.name()
        );
        seen.push((doc.name(), text));
    }
    ensure!(
        seen.len() >= 2,
        "expected a proxy DaemonSet per zone, found {}",
        seen.len()
    );
    for (name, text) in &seen[1..] {
        ensure!(
            *text == seen[0].1,
            "{name} differs from {} in more than its zone",
            seen[0].0
        );
    }
    Ok(())
}

pub(crate) fn proxy_pods_and_units_outlast_their_drain() -> Result<()> {
    for doc in manifests()? {
        let Some(pod) = doc.pod() else { continue };
        for container in containers(pod).filter(|c| runs(c, "lockcell-proxy")) {
            let budget = drain_budget(&command_line(container))?;
            let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap_or(30);
            ensure!(
                Duration::from_secs(grace) > budget,
                "{}: terminationGracePeriodSeconds {grace} is not above the drain's {budget:?}",
                doc.name()
            );
        }
    }
    for unit in files("deploy/systemd", "service")? {
        let text = std::fs::read_to_string(&unit)?;
        let line = exec_start(&text);
        if line.first().is_some_and(|p| p.ends_with("/lockcell-proxy")) {
            let budget = drain_budget(&line)?;
            let stop = setting(&text, "TimeoutStopSec").context("no TimeoutStopSec")?;
            let stop = humantime::parse_duration(&stop)
                .or_else(|_| humantime::parse_duration(&format!("{stop}s")))?;
            ensure!(
                stop > budget,
                "{}: TimeoutStopSec {stop:?} is not above {budget:?}",
                unit.display()
            );
        }
    }
    Ok(())
}

/// The port number a probe or hook names (a number, or a container port's name).
fn port_number(container: &Value, port: &Value) -> Option<u64> {
    port.as_u64().or_else(|| {
        container["ports"]
            .as_array()?
            .iter()
            .find(|p| p["name"] == *port)?["containerPort"]
            .as_u64()
    })
}

pub(crate) fn probes_and_the_drain_hook_use_the_servers_paths() -> Result<()> {
    let proxy_routes = read("proxy/src/admin.rs")?;
    let audit_routes = read("cell/src/bin/lockcell-cell/http.rs")?;
    for doc in manifests()? {
        let Some(pod) = doc.pod() else { continue };
        for container in containers(pod) {
            let line = command_line(container);
            let (routes, listen) = match line.first().map(String::as_str) {
                Some("lockcell-proxy") => (&proxy_routes, "--admin-listen"),
                Some("lockcell-cell") => (&audit_routes, "--listen"),
                _ => continue,
            };
            let port = flag(&line, listen).and_then(|a| a.rsplit(':').next()?.parse::<u64>().ok());
            for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
                let get = &container[probe]["httpGet"];
                let Some(path) = get["path"].as_str() else {
                    continue;
                };
                ensure!(
                    routes.contains(&format!("\"{path}\"")),
                    "{}: {probe} asks {path}, which the server does not serve",
                    doc.name()
                );
                ensure!(
                    port.is_some() && port_number(container, &get["port"]) == port,
                    "{}: {probe} is not on the {listen} port",
                    doc.name()
                );
            }
            if line[0] == "lockcell-proxy" {
                ensure!(
                    container["readinessProbe"]["httpGet"]["path"] == "/readyz"
                        && container["livenessProbe"]["httpGet"]["path"] == "/healthz",
                    "{}: a proxy is ready on /readyz and alive on /healthz",
                    doc.name()
                );
                if let Some(hook) = container["lifecycle"]["preStop"]["exec"]["command"].as_array()
                {
                    let hook = serde_json::to_string(hook)?;
                    let drain = format!(":{}/drain", port.unwrap_or_default());
                    ensure!(
                        hook.contains(&drain),
                        "{}: preStop does not POST {drain}",
                        doc.name()
                    );
                }
            }
        }
    }
    Ok(())
}

pub(crate) fn no_max_unavailable_budget_covers_a_daemonset() -> Result<()> {
    let docs = manifests()?;
    for budget in docs.iter().filter(|d| d.kind() == "PodDisruptionBudget") {
        if budget.value["spec"]["maxUnavailable"].is_null() {
            continue;
        }
        let wanted = budget.value["spec"]["selector"]["matchLabels"]
            .as_object()
            .context("a budget selects by matchLabels")?;
        for set in docs.iter().filter(|d| d.kind() == "DaemonSet") {
            let labels = &set.value["spec"]["template"]["metadata"]["labels"];
            ensure!(
                !wanted.iter().all(|(k, v)| labels[k] == *v),
                "{} covers {} with maxUnavailable, which Kubernetes supports only for controllers with a scale subresource",
                budget.name(),
                set.name()
            );
        }
    }
    Ok(())
}

pub(crate) fn kubernetes_validate() -> Result<PathBuf, String> {
    let venv = root().join(".lockcell-tools/venv/bin/kubernetes-validate");
    if venv.is_file() {
        return Ok(venv);
    }
    on_path("kubernetes-validate").ok_or_else(|| {
        "kubernetes-validate is not installed (`make setup` puts it into .lockcell-tools/venv)"
            .to_string()
    })
}

pub(crate) fn manifests_pass_the_schema_validator(validator: PathBuf) -> Result<()> {
    let manifests = manifest_files()?;
    for version in [Some(OLDEST_KUBERNETES), None] {
        let mut command = Command::new(&validator);
        command.args(["--strict", "--quiet"]);
        if let Some(version) = version {
            command.args(["--kubernetes-version", version]);
        }
        let out = command
            .args(&manifests)
            .output()
            .context("running kubernetes-validate")?;
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        // --quiet prints only warnings (a kind it has no schema for) and failures.
        ensure!(
            out.status.success() && said.trim().is_empty(),
            "kubernetes-validate (Kubernetes {}) {}:\n{said}",
            version.unwrap_or("newest"),
            out.status
        );
    }
    Ok(())
}

/// The kustomization applies every manifest, every container that runs a lockcell
/// binary names the image as the kustomization replaces it, and `make image` tags the
/// image it builds with the name and tag the kustomization sets.
pub(crate) fn the_kustomization_applies_every_manifest_and_names_the_image() -> Result<()> {
    let text = read(&format!("deploy/kubernetes/{KUSTOMIZATION}"))?;
    let kustomization: Value = serde_yaml::from_str(&text)?;
    let mut listed: Vec<&str> = kustomization["resources"]
        .as_array()
        .context("the kustomization lists no resources")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    listed.sort();
    let files = manifest_files()?;
    let mut names: Vec<String> = files
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    names.sort();
    ensure!(
        listed == names,
        "the kustomization lists {listed:?}; the manifests are {names:?}"
    );
    let images = kustomization["images"]
        .as_array()
        .context("the kustomization sets no image")?;
    let image = images
        .iter()
        .find(|i| i["name"] == IMAGE)
        .with_context(|| format!("the kustomization sets no image named {IMAGE:?}"))?;
    let (name, tag) = (image["newName"].as_str(), image["newTag"].as_str());
    let (Some(name), Some(tag)) = (name, tag) else {
        anyhow::bail!("the kustomization's {IMAGE:?} image needs newName and newTag as strings");
    };
    for doc in manifests()? {
        let Some(pod) = doc.pod() else { continue };
        for container in containers(pod) {
            let line = command_line(container);
            let program = line.first().map(String::as_str).unwrap_or_default();
            let ours = ["lockcell-proxy", "lockcell-cell", "lockctl", "chown"].contains(&program);
            let image_of = container["image"].as_str().unwrap_or_default();
            ensure!(
                !ours || image_of == IMAGE,
                "{}: container {} runs {program} from image {image_of:?}, not {IMAGE:?} (which the kustomization sets)",
                doc.name(),
                container["name"]
            );
            ensure!(
                ours || image_of != IMAGE,
                "{}: container {} runs {program:?} from lockcell's image",
                doc.name(),
                container["name"]
            );
        }
    }
    let out = Command::new("sh")
        .arg(root().join("deploy/image/image.sh"))
        .arg("name")
        .output()
        .context("running deploy/image/image.sh name")?;
    let tagged = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    ensure!(
        out.status.success() && tagged == format!("{name}:{tag}"),
        "make image tags {tagged:?} (stderr: {}), the kustomization sets {name}:{tag}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}
