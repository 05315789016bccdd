"""Cross-file checks for one rendered deployment: do the pieces agree with each other?

The service config (ConfigMap config.yaml, loaded with MTPServeConfig) is the source of truth for
the gRPC, HTTP and metrics ports. Against it, check_consistency compares the Service, the Ray head's
container ports and probes (gRPC probes on the gRPC port, HTTP probes on /health of the HTTP port),
the PodMonitor, the Dockerfile's EXPOSE, the image everywhere, the --config path of what runs the server (a
RayJob's entrypoint, a RayService's Serve application, whose replica's resource the head must offer), the GPU
worker groups and every container's security settings. The image itself (the Dockerfile, or a built
image's config) must expose exactly the ports the Services publish, carry the manifests' image name and
tag in its labels, and run as the pods' uid.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from mtpserve.deploy.dockerfile import ImageFacts
from mtpserve.deploy.manifest import REPO_ROOT, json_path, pod_templates
from mtpserve.deploy.render import Doc

IMAGE = "ghcr.io/mtpserve/mtpserve:0.1.0"
DOCKERFILE = REPO_ROOT / "deploy" / "docker" / "Dockerfile"
CONFIG_KEY = "config.yaml"
GPU = "nvidia.com/gpu"
HEALTH_PATH = "/health"
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
UID = 1000  # the runAsUser of every pod, and so the image's user
VERSION_LABEL = "org.opencontainers.image.version"
TITLE_LABEL = "org.opencontainers.image.title"


def served_ports(cfg: Any) -> dict[str, int]:
    """Port name -> number of every port the config serves (the HTTP API only when server.http_port is set)."""
    ports = {"grpc": cfg.server.port, "metrics": cfg.server.metrics_port}
    if cfg.server.http_port is not None:
        ports["http"] = cfg.server.http_port
    return ports


def project_version(pyproject: Path = REPO_ROOT / "pyproject.toml") -> str:
    """The [project] version string of pyproject.toml."""
    match = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(encoding="utf-8"), re.M)
    if match is None:
        raise ValueError(f"{pyproject}: no version")
    return match.group(1)


def dockerfile_exposed_ports(text: str) -> set[int]:
    """Port numbers of every EXPOSE instruction (protocol suffixes dropped)."""
    ports: set[int] = set()
    for line in text.splitlines():
        words = line.split()
        if words and words[0].upper() == "EXPOSE":
            ports.update(int(w.split("/")[0]) for w in words[1:])
    return ports


def _by_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d.get("kind") == kind]


def _label(doc: Doc) -> str:
    return f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"


def load_service_config(docs: list[Doc]) -> tuple[Any, Doc]:
    """(MTPServeConfig, ConfigMap) of the one ConfigMap that carries config.yaml."""
    from mtpserve.workers.config import MTPServeConfig

    maps = [d for d in _by_kind(docs, "ConfigMap") if CONFIG_KEY in (d.get("data") or {})]
    if len(maps) != 1:
        raise ValueError(f"expected one ConfigMap with {CONFIG_KEY}, found {len(maps)}")
    data = yaml.safe_load(maps[0]["data"][CONFIG_KEY]) or {}
    return MTPServeConfig.from_dict(data), maps[0]


def head_templates(docs: list[Doc]) -> Iterator[tuple[Doc, list[Any], Doc]]:
    """(owner, path, template) of every Ray head pod template."""
    for doc in docs:
        for path, template in pod_templates(doc):
            if "headGroupSpec" in path:
                yield doc, path, template


def _ports(container: Doc) -> dict[str, int]:
    return {p.get("name"): p.get("containerPort") for p in container.get("ports") or [] if p.get("name")}


def _head_labels(template: Doc) -> dict[str, str]:
    labels = dict((template.get("metadata") or {}).get("labels") or {})
    labels["ray.io/node-type"] = "head"  # KubeRay sets it on every head pod
    return labels


def _selects(selector: Any, labels: dict[str, str]) -> bool:
    if not isinstance(selector, dict) or not selector:
        return False
    return all(labels.get(k) == v for k, v in selector.items())


def _service_errors(docs: list[Doc], cfg: Any, heads: list[Doc]) -> Iterator[str]:
    wanted = served_ports(cfg)
    for svc in _by_kind(docs, "Service"):
        spec = svc.get("spec") or {}
        ports = {p.get("name"): (i, p) for i, p in enumerate(spec.get("ports") or [])}
        for name, number in wanted.items():
            if name not in ports:
                yield f"{_label(svc)}: no port named {name!r}"
                continue
            i, port = ports[name]
            if port.get("port") != number:
                yield f"{_label(svc)}: {json_path(['spec', 'ports', i, 'port'])}: {port.get('port')} != {number}"
            if port.get("targetPort") not in (name, number):
                yield f"{_label(svc)}: {json_path(['spec', 'ports', i, 'targetPort'])}: not {name!r}/{number}"
        if ports.get("grpc", (0, {}))[1].get("appProtocol") != "grpc":
            yield f"{_label(svc)}: the grpc port needs appProtocol: grpc"
        if not any(_selects(spec.get("selector") or {}, _head_labels(h)) for h in heads):
            yield f"{_label(svc)}: selector {spec.get('selector')} matches no Ray head pod"


def _pod_monitor_errors(docs: list[Doc], heads: list[Doc]) -> Iterator[str]:
    for mon in _by_kind(docs, "PodMonitor"):
        spec = mon.get("spec") or {}
        matching = [h for h in heads if _selects((spec.get("selector") or {}).get("matchLabels"), _head_labels(h))]
        if not matching:
            yield f"{_label(mon)}: selector matches no Ray head pod"
        for i, ep in enumerate(spec.get("podMetricsEndpoints") or []):
            for head in matching:
                if ep.get("port") not in _ports(head["spec"]["containers"][0]):
                    where = json_path(["spec", "podMetricsEndpoints", i, "port"])
                    yield f"{_label(mon)}: {where}: no head container port named {ep.get('port')!r}"


SERVE_APP = "mtpserve.cluster.cli.serve_app:app"  # the Serve application a RayService runs the server with


def servers_on(owner: Doc, docs: list[Doc]) -> list[tuple[Doc, str, Doc]]:
    """(object, command line, its args) of what runs the server on owner's head: the RayJobs whose driver runs
    there (owner itself, or clusterSelector jobs aimed at it; args empty), or a RayService's mtpserve Serve
    application (its `serve` flags, and its args)."""
    if owner.get("kind") == "RayService":
        return [(owner, " ".join(a.get("argv") or []), a) for a in serve_app_args(owner)]
    if owner.get("kind") == "RayJob":
        jobs = [owner]
    else:
        name = (owner.get("metadata") or {}).get("name")
        jobs = [
            j
            for j in _by_kind(docs, "RayJob")
            if ((j.get("spec") or {}).get("clusterSelector") or {}).get("ray.io/cluster") == name
        ]
    return [(j, str((j.get("spec") or {}).get("entrypoint", "")), {}) for j in jobs]


def serve_app_args(service: Doc) -> list[Doc]:
    """The args of every application of a RayService's serveConfigV2 that runs mtpserve (SERVE_APP)."""
    config = yaml.safe_load((service.get("spec") or {}).get("serveConfigV2") or "") or {}
    apps = config.get("applications") or []
    return [a.get("args") or {} for a in apps if isinstance(a, dict) and a.get("import_path") == SERVE_APP]


def _offered_resources(head_spec: Doc) -> dict[str, Any]:
    """The custom resources a head's rayStartParams offer (a JSON object in a string)."""
    raw = (head_spec.get("rayStartParams") or {}).get("resources")
    try:
        offered = yaml.safe_load(raw) if isinstance(raw, str) else {}
    except yaml.YAMLError:
        return {}
    return offered if isinstance(offered, dict) else {}


def _mounted_volumes(template: Doc) -> Iterator[tuple[str, Doc]]:
    """(mountPath without a trailing '/', volume) for each volume mounted in the head container."""
    container = template["spec"]["containers"][0]
    volumes = {v.get("name"): v for v in template["spec"].get("volumes") or []}
    for mount in container.get("volumeMounts") or []:
        yield str(mount.get("mountPath", "")).rstrip("/"), volumes.get(mount.get("name")) or {}


def _config_mount(template: Doc, config_map: Doc) -> str | None:
    for path, volume in _mounted_volumes(template):
        if (volume.get("configMap") or {}).get("name") == config_map["metadata"]["name"]:
            return path
    return None


def _secret_mounts(template: Doc) -> dict[str, str]:
    """mountPath -> Secret name for the head container's Secret volumes."""
    secrets = ((path, (volume.get("secret") or {}).get("secretName")) for path, volume in _mounted_volumes(template))
    return {path: str(name) for path, name in secrets if name}


def _credential_errors(where: str, template: Doc, cfg: Any) -> Iterator[str]:
    """Every credential file the server config names must sit in a Secret mounted on the head."""
    sc = cfg.server
    files = {"server.auth_token_file": sc.auth_token_file, "server.tls.cert_file": sc.tls.cert_file}
    files |= {"server.tls.key_file": sc.tls.key_file, "server.tls.client_ca_file": sc.tls.client_ca_file}
    mounts = _secret_mounts(template)
    for field, path in files.items():
        if path is not None and not any(path.startswith(m + "/") for m in mounts):
            yield f"{where}: {field} {path!r} is not inside a Secret volume mounted on the head"


def _head_errors(
    owner: Doc, path: list[Any], template: Doc, cfg: Any, config_map: Doc, servers: list[tuple[Doc, str, Doc]]
) -> Iterator[str]:
    where = f"{_label(owner)}: {json_path(path)}"
    container = template["spec"]["containers"][0]
    ports = _ports(container)
    for name, number in served_ports(cfg).items():
        if ports.get(name) != number:
            yield f"{where}: container port {name!r} is {ports.get(name)}, config says {number}"
    yield from _probe_errors(where, container, cfg)
    head_spec = _group_of(owner, path)
    if str((head_spec.get("rayStartParams") or {}).get("num-gpus")) != "0":
        yield f"{where}: the head must start with rayStartParams num-gpus: '0'"
    yield from _credential_errors(where, template, cfg)
    mount = _config_mount(template, config_map)
    if mount is None:
        yield f"{where}: the head does not mount ConfigMap {config_map['metadata']['name']}"
        return
    if not servers:
        yield f"{where}: nothing runs the server on this head (a RayJob, or a RayService with {SERVE_APP})"
    for runner, command, args in servers:
        config_arg = f"--config {mount}/{CONFIG_KEY}"
        if config_arg not in command:
            what = "the Serve application's args.argv" if runner.get("kind") == "RayService" else "entrypoint"
            yield f"{_label(runner)}: {what} does not pass {config_arg!r}"
        resource = args.get("endpoint_resource")
        if resource is not None and resource not in _offered_resources(head_spec):
            yield f"{_label(runner)}: the head's rayStartParams do not offer resource {resource!r} (endpoint_resource)"


def _probe_errors(where: str, container: Doc, cfg: Any) -> Iterator[str]:
    """gRPC probes on the gRPC port; HTTP probes on /health of the HTTP API (which the config must serve),
    over HTTPS when it serves TLS."""
    for probe in PROBES:
        spec = container.get(probe) or {}
        grpc = spec.get("grpc")
        if grpc is not None and grpc.get("port") != cfg.server.port:
            yield f"{where}: {probe}.grpc.port is {grpc.get('port')}, config says {cfg.server.port}"
        get = spec.get("httpGet")
        if get is None:
            continue
        if cfg.server.http_port is None:
            yield f"{where}: {probe}.httpGet needs the HTTP API, but server.http_port is not set"
        elif get.get("port") not in ("http", cfg.server.http_port):
            yield f"{where}: {probe}.httpGet.port is {get.get('port')!r}, config says {cfg.server.http_port}"
        if get.get("path") != HEALTH_PATH:
            yield f"{where}: {probe}.httpGet.path is {get.get('path')!r}, not {HEALTH_PATH!r}"
        scheme = "HTTPS" if cfg.server.tls.enabled else "HTTP"
        if get.get("scheme", "HTTP") != scheme:
            yield f"{where}: {probe}.httpGet.scheme is {get.get('scheme', 'HTTP')}, the API serves {scheme}"


def _gpu_errors(docs: list[Doc], cfg: Any) -> Iterator[str]:
    total = 0
    for doc in docs:
        for path, template in pod_templates(doc):
            if "workerGroupSpecs" not in path:
                continue
            res = template["spec"]["containers"][0].get("resources") or {}
            req, lim = (res.get("requests") or {}).get(GPU), (res.get("limits") or {}).get(GPU)
            if req is None and lim is None:
                continue
            where = f"{_label(doc)}: {json_path(path)}"
            if req != lim:
                yield f"{where}: {GPU} requests ({req}) and limits ({lim}) differ"
            tolerations = template["spec"].get("tolerations") or []
            if not any(t.get("key") == GPU for t in tolerations):
                yield f"{where}: GPU workers need a toleration for {GPU}"
            group = _group_of(doc, path)
            total += int(lim or 0) * int(group.get("replicas", 1))
    if cfg.model.device == "cuda" and total < cfg.parallel.tp_size:
        yield f"parallel.tp_size is {cfg.parallel.tp_size} but the worker groups have {total} GPUs"
    if cfg.model.device == "cpu" and total:
        yield f"model.device is cpu but the worker groups request {total} GPUs"


def _group_of(doc: Doc, path: list[Any]) -> Doc:
    node: Any = doc
    for part in path[:-1]:
        node = node[part]
    return node


def _container_errors(docs: list[Doc], image: str) -> Iterator[str]:
    for doc in docs:
        for path, template in pod_templates(doc):
            pod_sc = template["spec"].get("securityContext") or {}
            for kind in ("initContainers", "containers"):
                for i, c in enumerate(template["spec"].get(kind) or []):
                    where = f"{_label(doc)}: {json_path([*path, 'spec', kind, i])}"
                    sc = {**pod_sc, **(c.get("securityContext") or {})}
                    if c.get("image") != image:
                        yield f"{where}: image {c.get('image')!r} is not {image!r}"
                    if not (c.get("resources") or {}).get("requests"):
                        yield f"{where}: no resource requests"
                    if sc.get("runAsNonRoot") is not True or sc.get("runAsUser") != 1000:
                        yield f"{where}: must run as non-root user 1000"
                    if (c.get("securityContext") or {}).get("allowPrivilegeEscalation") is not False:
                        yield f"{where}: allowPrivilegeEscalation must be false"


def published_ports(docs: list[Doc]) -> dict[int, str]:
    """Container port number -> the Service port that publishes it (targetPort resolved on the Ray head)."""
    named: dict[str, int] = {}
    for _, _, template in head_templates(docs):
        named |= _ports(template["spec"]["containers"][0])
    out: dict[int, str] = {}
    for svc in _by_kind(docs, "Service"):
        for port in (svc.get("spec") or {}).get("ports") or []:
            target = port.get("targetPort", port.get("port"))
            number = named.get(target) if isinstance(target, str) else target
            if isinstance(number, int):
                out[number] = f"{_label(svc)} port {port.get('name', port.get('port'))!r}"
    return out


def image_errors(facts: ImageFacts, where: str, docs: list[Doc], image: str = IMAGE) -> Iterator[str]:
    """Where an image's ports, labels and user disagree with the manifests that run it under `image`."""
    published = published_ports(docs)
    for port in sorted(set(published) - facts.ports):
        yield f"{where}: EXPOSE lacks {port} ({published[port]})"
    for port in sorted(facts.ports - set(published)):
        yield f"{where}: exposes {port}, which no Service publishes"
    name, _, tag = image.rpartition(":")
    if facts.labels.get(VERSION_LABEL) != tag:
        yield f"{where}: label {VERSION_LABEL} is {facts.labels.get(VERSION_LABEL)!r}, the manifests' image tag {tag!r}"
    if facts.labels.get(TITLE_LABEL) != name.rsplit("/", 1)[-1]:
        yield f"{where}: label {TITLE_LABEL} is {facts.labels.get(TITLE_LABEL)!r}, the manifests' image is {name!r}"
    if facts.uid() != UID:
        yield f"{where}: USER is {facts.user!r}; the pods run as uid {UID}, so the image must too (numeric)"


def built_image_errors(oci_config: dict[str, Any], docs: list[Doc], image: str = IMAGE) -> list[str]:
    """Where a built image's config (`buildah inspect`: OCIv1.config) disagrees with the manifests."""
    return list(image_errors(ImageFacts.from_oci_config(oci_config), f"image {image}", docs, image))


def check_consistency(docs: list[Doc], dockerfile: Path | None = DOCKERFILE, image: str = IMAGE) -> list[str]:
    """Every disagreement between the objects of one rendered deployment (and the Dockerfile)."""
    try:
        cfg, config_map = load_service_config(docs)
    except Exception as exc:  # a config that does not load is itself the finding
        return [f"service config: {exc}"]
    errors: list[str] = []
    if image.rsplit(":", 1)[-1] != project_version():
        errors.append(f"image tag of {image} differs from the project version {project_version()}")
    heads = list(head_templates(docs))
    if not heads:
        errors.append("no Ray head pod template (RayCluster, RayJob.rayClusterSpec or RayService.rayClusterConfig)")
    for owner, path, template in heads:
        errors.extend(_head_errors(owner, path, template, cfg, config_map=config_map, servers=servers_on(owner, docs)))
    errors.extend(_service_errors(docs, cfg, [t for _, _, t in heads]))
    errors.extend(_pod_monitor_errors(docs, [t for _, _, t in heads]))
    if _by_kind(docs, "PodMonitor") and cfg.server.metrics_host in ("127.0.0.1", "localhost", "::1", "[::1]"):
        errors.append(f"server.metrics_host is {cfg.server.metrics_host}: the PodMonitor cannot scrape a loopback port")
    errors.extend(_gpu_errors(docs, cfg))
    errors.extend(_container_errors(docs, image))
    if dockerfile is not None:
        exposed = dockerfile_exposed_ports(Path(dockerfile).read_text(encoding="utf-8"))
        for port in served_ports(cfg).values():
            if port not in exposed:
                errors.append(f"{dockerfile}: EXPOSE lacks {port}")
        facts = ImageFacts.from_dockerfile(Path(dockerfile).read_text(encoding="utf-8"))
        errors.extend(image_errors(facts, str(dockerfile), docs, image))
    return errors
