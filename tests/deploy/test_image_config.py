"""Offline checks of the container image's definition: the Dockerfile and a built image's config against the
KubeRay manifests, and the pip settings that the local image build passes in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mtpserve.deploy import consistency, pip_passthrough, render
from mtpserve.deploy.dockerfile import ImageFacts, instructions, labels

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE_TEXT = consistency.DOCKERFILE.read_text()


def base_docs() -> list[dict[str, Any]]:
    return render.render(REPO / "deploy" / "k8s" / "base")


def errors_with(tmp_path: Path, text: str, docs: list[dict[str, Any]] | None = None) -> list[str]:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(text)
    return consistency.check_consistency(docs if docs is not None else base_docs(), dockerfile)


# --- reading a Dockerfile ------------------------------------------------------------------------


def test_instructions_join_continuations_and_skip_comments() -> None:
    text = '# c\nFROM x\nLABEL a="1 2" \\\n      b=3\n\nRUN echo \\\n  # a comment inside\n  hi\nexpose 1/tcp 2\n'
    assert list(instructions(text)) == [
        ("FROM", "x"),
        ("LABEL", 'a="1 2"  b=3'),
        ("RUN", "echo  hi"),
        ("EXPOSE", "1/tcp 2"),
    ]
    assert labels(text) == {"a": "1 2", "b": "3"}
    facts = ImageFacts.from_dockerfile(text + "USER ray\nUSER 1000:100\n")
    assert (facts.ports, facts.user, facts.uid()) == ({1, 2}, "1000:100", 1000)
    assert ImageFacts(user="ray").uid() is None and ImageFacts().uid() is None
    with pytest.raises(ValueError, match="not key=value"):
        labels("LABEL justakey\n")


def test_the_dockerfile_agrees_with_the_manifests() -> None:
    facts = ImageFacts.from_dockerfile(DOCKERFILE_TEXT)
    assert facts.labels[consistency.VERSION_LABEL] == consistency.project_version()
    assert facts.ports == set(consistency.published_ports(base_docs())) >= {50051, 9090}
    assert list(consistency.image_errors(facts, "Dockerfile", base_docs())) == []


# --- disagreements are found ---------------------------------------------------------------------


EXPOSE_LINE = next(line for line in DOCKERFILE_TEXT.splitlines() if line.startswith("EXPOSE "))
PUBLISHED = sorted(consistency.published_ports(base_docs()))  # 50051 and 9090, plus whatever the manifests add
WITHOUT_METRICS = "EXPOSE " + " ".join(str(p) for p in PUBLISHED if p != 9090)


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ('image.version="0.1.0"', 'image.version="0.2.0"', "label org.opencontainers.image.version is '0.2.0'"),
        ('image.title="mtpserve"', 'image.title="server"', "label org.opencontainers.image.title is 'server'"),
        (EXPOSE_LINE, WITHOUT_METRICS, "EXPOSE lacks 9090 (Service/mtpserve port 'metrics')"),
        (EXPOSE_LINE, EXPOSE_LINE + " 18000/tcp", "exposes 18000, which no Service publishes"),
        ("USER 1000:100", "USER ray", "USER is 'ray'; the pods run as uid 1000"),
        ("USER 1000:100", "USER 0", "USER is '0'"),
        ("USER 1000:100", "", "USER is None"),
    ],
    ids=["version", "title", "missing port", "extra port", "named user", "root", "no user"],
)
def test_dockerfile_disagreements_are_found(tmp_path: Path, old: str, new: str, expected: str) -> None:
    assert old in DOCKERFILE_TEXT
    errors = errors_with(tmp_path, DOCKERFILE_TEXT.replace(old, new))
    assert any(expected in e for e in errors), errors


def test_a_port_the_manifests_add_must_be_exposed(tmp_path: Path) -> None:
    docs = base_docs()
    svc = next(d for d in docs if d["kind"] == "Service")
    svc["spec"]["ports"].append({"name": "extra", "port": 80, "targetPort": "extra"})
    head = next(t for _, _, t in consistency.head_templates(docs))["spec"]["containers"][0]
    head["ports"].append({"name": "extra", "containerPort": 18000})
    assert consistency.published_ports(docs)[18000] == "Service/mtpserve port 'extra'"
    errors = errors_with(tmp_path, DOCKERFILE_TEXT, docs)
    assert "EXPOSE lacks 18000 (Service/mtpserve port 'extra')" in str(errors), errors
    assert errors_with(tmp_path, DOCKERFILE_TEXT.replace(EXPOSE_LINE, EXPOSE_LINE + " 18000"), docs) == []


def test_built_image_config_is_checked_too() -> None:
    good = {
        "User": "1000:100",
        "ExposedPorts": {f"{p}/tcp": {} for p in PUBLISHED},
        "Labels": {"org.opencontainers.image.title": "mtpserve", "org.opencontainers.image.version": "0.1.0"},
    }
    assert consistency.built_image_errors(good, base_docs()) == []
    bad = {**good, "User": "", "ExposedPorts": {f"{p}/tcp": {} for p in PUBLISHED if p != 9090}}
    errors = consistency.built_image_errors(bad, base_docs())
    assert errors == [
        "image ghcr.io/mtpserve/mtpserve:0.1.0: EXPOSE lacks 9090 (Service/mtpserve port 'metrics')",
        "image ghcr.io/mtpserve/mtpserve:0.1.0: USER is None; the pods run as uid 1000, so the image must too "
        "(numeric)",
    ]


# --- pip settings passed into the build ----------------------------------------------------------

CONFIG_LIST = """global.cert='/etc/ssl/certs/ca.crt'
global.extra-index-url='file:///srv/pypi/simple https://mirror.example/simple'
global.find-links='/srv/wheels'
install.find-links='/srv/install-wheels'
:env:.default-timeout='180'
global.no-cache-dir='1'
"""


def test_pip_settings_take_pips_precedence() -> None:
    sections = pip_passthrough.parse_config_list(CONFIG_LIST)
    assert sections["global"]["extra-index-url"] == "file:///srv/pypi/simple https://mirror.example/simple"
    settings = pip_passthrough.effective_settings(sections, {"PIP_CERT": "/env/ca.pem", "PIP_INDEX_URL": " "})
    assert settings == {
        "PIP_EXTRA_INDEX_URL": "file:///srv/pypi/simple https://mirror.example/simple",
        "PIP_FIND_LINKS": "/srv/install-wheels",  # [install] over [global]
        "PIP_CERT": "/env/ca.pem",  # the environment over any file; a blank value is no value
        "PIP_DEFAULT_TIMEOUT": "180",
    }


def test_local_paths_are_mounted_where_pip_looks(tmp_path: Path) -> None:
    (tmp_path / "pypi" / "simple").mkdir(parents=True)
    (tmp_path / "wheels" / "sub").mkdir(parents=True)
    (tmp_path / "ca.pem").write_text("x")
    settings = {
        "PIP_EXTRA_INDEX_URL": f"file://{tmp_path}/pypi/simple https://mirror.example/simple",
        "PIP_FIND_LINKS": f"{tmp_path}/wheels/sub {tmp_path}/wheels file://{tmp_path}/gone",
        "PIP_CERT": f"{tmp_path}/ca.pem",
        "PIP_TRUSTED_HOST": "/not/a/path",
    }
    paths = pip_passthrough.local_paths(settings)
    # an index counts from its parent (its pages link to ../../files); nested and missing paths drop out
    assert paths == [tmp_path / "ca.pem", tmp_path / "pypi", tmp_path / "wheels"]
    args = pip_passthrough.build_arguments({"PIP_CERT": settings["PIP_CERT"]}, paths[:1])
    assert args == [f"--build-arg=PIP_CERT={tmp_path}/ca.pem", f"--volume={tmp_path}/ca.pem:{tmp_path}/ca.pem:ro"]


def test_every_passed_setting_is_a_dockerfile_arg() -> None:
    args = {rest.split("=")[0] for word, rest in instructions(DOCKERFILE_TEXT) if word == "ARG"}
    assert {pip_passthrough.env_name(s) for s in pip_passthrough.SETTINGS} <= args
    assert {"BASE_IMAGE", "TORCH_SPEC", "TORCH_INDEX_URL"} <= args
