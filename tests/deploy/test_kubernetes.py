"""deploy/kubernetes: every manifest validates strictly against the Kubernetes API schemas
(``kubernetes-validate``, schemas shipped in its wheel: no network), and the pieces agree
with what the code needs (see the comments in coordinator-daemonset.yaml): one uid and the
host's PID namespace for the coordinator and the engines, the host's /dev/shm and the
socket directory at the same paths in both, the config that the DaemonSet renders loads,
and its ports are the ones the pod, the Services and the scrape annotations name."""

from __future__ import annotations

import copy
import json
import re
import tomllib
from pathlib import Path, PurePosixPath

import kubernetes_validate
import pytest
import yaml

from tiercache.config import config_from_dict
from tiercache.sizes import parse_size

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "deploy" / "kubernetes"
# the oldest Kubernetes these manifests promise, and the newest the validator ships
VERSIONS = ["1.30.0", kubernetes_validate.utils.latest_version()]


def _documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        docs += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def _find(kind: str, name: str) -> dict:
    found = [d for _, d in _documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def _pod(kind: str, name: str) -> dict:
    return _find(kind, name)["spec"]["template"]


def _container(pod: dict, name: str) -> dict:
    return next(c for c in pod["spec"]["containers"] if c["name"] == name)


def _mounts(pod: dict, container: dict) -> dict[str, dict]:
    """mountPath -> the volume mounted there."""
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    return {m["mountPath"]: volumes[m["volumeName"] if "volumeName" in m else m["name"]]
            for m in container.get("volumeMounts", [])}


def _raw_config() -> dict:
    text = _find("ConfigMap", "tiercache-config")["data"]["node.toml"]
    return tomllib.loads(text.replace("@POD_IP@", "10.1.2.3"))  # what render-config does


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_validates_strictly(version):
    docs = _documents()
    assert {d["kind"] for _, d in docs} >= {"Namespace", "ConfigMap", "DaemonSet", "Service",
                                            "Deployment"}
    for _, doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # raises, naming the field


def test_the_validator_rejects_a_wrong_field():
    """The check above can fail: a misspelt field of the pod is rejected."""
    doc = copy.deepcopy(_find("DaemonSet", "tiercache-coordinator"))
    doc["spec"]["template"]["spec"]["hostPid"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, VERSIONS[0], strict=True)


def test_the_rendered_config_loads_and_is_the_one_the_coordinator_serves(tmp_path):
    raw = _raw_config()
    coordinator = _container(_pod("DaemonSet", "tiercache-coordinator"), "coordinator")
    assert coordinator["command"][-1] == "/etc/tiercache/node.toml"
    raw["disk"]["path"] = str(tmp_path)  # the one path that must exist to build a Config
    config = config_from_dict(raw)
    assert config.cluster is not None and config.cluster.local_hostname == "10.1.2.3"


def test_coordinator_and_engines_share_uid_pid_namespace_shm_and_socket_directory():
    raw = _raw_config()
    coord_pod = _pod("DaemonSet", "tiercache-coordinator")
    engine_pod = _pod("Deployment", "vllm-llama")
    coord, engine = _container(coord_pod, "coordinator"), _container(engine_pod, "vllm")
    uid = coord_pod["spec"]["securityContext"]["runAsUser"]
    trusted = raw.get("control", {}).get("trusted_uid", -1)
    assert engine_pod["spec"]["securityContext"]["runAsUser"] in (uid, trusted)
    assert coord_pod["spec"]["hostPID"] is True and engine_pod["spec"]["hostPID"] is True
    for pod, container in ((coord_pod, coord), (engine_pod, engine)):
        mounts = _mounts(pod, container)
        assert mounts["/dev/shm"]["hostPath"]["path"] == "/dev/shm"  # the region's home
    socket_dir = PurePosixPath(raw["control"]["socket"]).parent
    shared = [path for path, volume in _mounts(coord_pod, coord).items()
              if "hostPath" in volume and socket_dir.is_relative_to(path)]
    assert len(shared) == 1  # the socket lies on a host directory ...
    host = _mounts(coord_pod, coord)[shared[0]]["hostPath"]["path"]
    assert _mounts(engine_pod, engine)[shared[0]]["hostPath"]["path"] == host  # ... both see
    # the socket's directory is made the service uid's, 0700, before the coordinator starts
    prepare = next(c for c in coord_pod["spec"]["initContainers"] if c["name"] == "prepare")
    script = prepare["command"][-1]
    assert re.search(rf"chown {uid}:{uid} [^&]*{socket_dir}\b", script)
    assert re.search(rf"chmod 0700 [^&]*{socket_dir}\b", script)
    ext = json.loads(engine["command"][engine["command"].index("--kv-transfer-config") + 1])
    extra = ext["kv_connector_extra_config"]
    assert extra["spec_module_path"] == "tiercache.vllm"
    assert extra["tiercache_instance"] == raw["instance"]["name"]


def test_the_cluster_key_is_installed_as_the_coordinator_trusts_it():
    """A key file of the service uid, 0600 (``tiercache.tiers.cluster_key``), copied from
    the Secret (whose files are root's) into the config directory the coordinator reads."""
    raw = _raw_config()
    pod = _pod("DaemonSet", "tiercache-coordinator")
    uid = pod["spec"]["securityContext"]["runAsUser"]
    key = PurePosixPath(raw["cluster"]["key_file"])
    coordinator_mounts = _mounts(pod, _container(pod, "coordinator"))
    assert "emptyDir" in coordinator_mounts[str(key.parent)]
    prepare = next(c for c in pod["spec"]["initContainers"] if c["name"] == "prepare")
    volumes = {m["mountPath"]: m["name"] for m in prepare["volumeMounts"]}
    secret = next(v for v in pod["spec"]["volumes"] if "secret" in v)
    script = prepare["command"][-1]
    source = next(path for path, name in volumes.items() if name == secret["name"])
    assert re.search(rf"cp {source}/\S+ {key}\b", script)
    assert f"chown {uid}:{uid} {key}" in script and f"chmod 0600 {key}" in script
    assert volumes[str(key.parent)] == "config"


def test_the_disk_tier_lives_on_the_host_and_is_the_service_uids():
    raw = _raw_config()
    pod = _pod("DaemonSet", "tiercache-coordinator")
    volume = _mounts(pod, _container(pod, "coordinator"))[raw["disk"]["path"]]
    assert "hostPath" in volume  # a new pod finds the disk tier warm
    prepare = next(c for c in pod["spec"]["initContainers"] if c["name"] == "prepare")
    assert raw["disk"]["path"] in prepare["command"][-1]


def test_ports_agree_between_config_pods_services_and_scrape_annotations():
    raw = _raw_config()
    pod = _pod("DaemonSet", "tiercache-coordinator")
    ports = {p["name"]: p["containerPort"] for p in _container(pod, "coordinator")["ports"]}
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == raw["exporter"]["port"] == ports["metrics"]
    assert raw["exporter"]["address"] == "0.0.0.0"  # reachable at the pod's IP
    for key, port_name in (("endpoint", "events"), ("replay_endpoint", "events-replay")):
        assert int(raw["events"][key].rsplit(":", 1)[1]) == ports[port_name]
    events = _find("Service", "tiercache-events")["spec"]
    assert events["selector"].items() <= pod["metadata"]["labels"].items()
    assert {p["targetPort"] for p in events["ports"]} == {"events", "events-replay"}

    master = _find("Service", "mooncake-master")
    host, port = raw["cluster"]["master"].rsplit(":", 1)
    assert host == f"mooncake-master.{master['metadata']['namespace']}.svc.cluster.local"
    service_ports = {p["targetPort"]: p["port"] for p in master["spec"]["ports"]}
    assert service_ports["rpc"] == int(port)
    assert f":{service_ports['metadata']}/metadata" in raw["cluster"]["metadata_server"]
    master_pod = _pod("Deployment", "mooncake-master")
    args = _container(master_pod, "master")["command"]
    master_ports = {p["name"]: p["containerPort"] for p in
                    _container(master_pod, "master")["ports"]}
    assert f"--rpc_port={master_ports['rpc']}" in args
    assert f"--http_metadata_server_port={master_ports['metadata']}" in args
    assert master["spec"]["selector"].items() <= master_pod["metadata"]["labels"].items()


def test_the_coordinators_memory_limit_covers_the_region_it_allocates():
    """tmpfs pages count against the cgroup that allocates them: the coordinator's
    posix_fallocate of the region, and the cluster tier's segment."""
    raw = _raw_config()
    pod = _pod("DaemonSet", "tiercache-coordinator")
    limit = _container(pod, "coordinator")["resources"]["limits"]["memory"]
    assert limit.endswith("Gi")
    need = parse_size(raw["region"]["capacity"]) + parse_size(raw["cluster"]["segment_size"])
    assert int(limit[:-2]) << 30 > need


def _policy_rules() -> list[tuple[dict, set[int]]]:
    """(the peer selector, the ports it may reach) per ingress rule of the coordinator's
    NetworkPolicy; a port range counts as its first port."""
    policy = _find("NetworkPolicy", "tiercache-coordinator")["spec"]
    assert policy["policyTypes"] == ["Ingress"]  # and nothing else comes in
    rules = []
    for rule in policy["ingress"]:
        assert len(rule["from"]) == 1, rule  # one kind of peer per rule
        rules.append((rule["from"][0], {p["port"] for p in rule["ports"]}))
    return rules


def test_the_network_policy_admits_routers_to_the_event_ports_the_config_names():
    """Only pods labelled as routers reach the event stream, on exactly the ports the
    ConfigMap's [events] endpoints bind (a port changed in one place only would leave
    routers out, or the stream open)."""
    raw = _raw_config()
    pod = _pod("DaemonSet", "tiercache-coordinator")
    policy = _find("NetworkPolicy", "tiercache-coordinator")
    assert policy["metadata"]["namespace"] == _find("DaemonSet", "tiercache-coordinator")[
        "metadata"]["namespace"]
    selected = policy["spec"]["podSelector"]["matchLabels"]
    assert selected.items() <= pod["metadata"]["labels"].items()  # it covers the pods
    event_ports = {int(raw["events"][key].rsplit(":", 1)[1])
                   for key in ("endpoint", "replay_endpoint")}
    to_events = [(peer, ports) for peer, ports in _policy_rules() if ports & event_ports]
    assert len(to_events) == 1
    peer, ports = to_events[0]
    assert ports == event_ports
    assert peer["podSelector"] == {"matchLabels": {"tiercache.io/router": "true"}}


def test_the_network_policy_admits_prometheus_to_the_exporter_and_coordinators_to_each_other():
    raw = _raw_config()
    pod = _pod("DaemonSet", "tiercache-coordinator")
    rules = _policy_rules()
    exporter = [peer for peer, ports in rules if ports == {raw["exporter"]["port"]}]
    assert [p["podSelector"]["matchLabels"] for p in exporter] == [
        {"app.kubernetes.io/name": "prometheus"}]
    coordinators = [peer for peer, _ in rules if "namespaceSelector" not in peer
                    and peer["podSelector"]["matchLabels"].items()
                    <= pod["metadata"]["labels"].items()]
    assert len(coordinators) == 1  # the cluster tier's transfer ports, between nodes
    policy = _find("NetworkPolicy", "tiercache-coordinator")["spec"]
    transfer = next(r for r in policy["ingress"] if r["from"][0] == coordinators[0])
    assert [(p["port"], p["endPort"]) for p in transfer["ports"]] == [(15000, 17000)]
    event_ports = {int(raw["events"][key].rsplit(":", 1)[1])
                   for key in ("endpoint", "replay_endpoint")}
    every = {port for _, ports in rules for port in ports}
    assert every == event_ports | {raw["exporter"]["port"], 15000}  # nothing else is open
