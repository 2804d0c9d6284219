"""deploy/kubernetes: every overlay rendered by `kubectl kustomize`, every object validated
against the Kubernetes API schemas of KUBERNETES_VERSION (kubernetes-validate, strict: an
unknown field fails) or, for CRD kinds, the schema vendored in deploy/kubernetes/schemas/;
every PAGEMESH_* variable a flag its service takes, with a value it parses; docs/kubernetes.md
naming only files, objects and variables that exist. The mesh's own invariants:
test_kubernetes_exposure.py (only the router is exposed, NetworkPolicies keep scheduler and
worker ports internal, every pod scraped), test_kubernetes_containers.py (resources, probes
and a grace period in every container, one GPU per worker), test_kubernetes_groups.py (ranks
cover tp x pp, groups avoid each other's nodes); the secrets and bind addresses:
test_kubernetes_secrets.py."""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import pytest

from pagemesh.runtime.config import _parse_bool
from tests.support.compose_files import command_parser, flag_variables
from tests.support.kube_manifests import (
    CRD_SCHEMAS,
    KUBERNETES_VERSION,
    OVERLAYS,
    SCHEMAS_DIR,
    SERVICE_MODULES,
    component,
    container_env,
    needs_kubectl,
    render,
    service_module,
    workloads,
)
from tests.support.paths import REPO_ROOT

pytestmark = needs_kubectl


# --- schemas ------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", [*OVERLAYS, "monitoring"])
def test_every_object_validates_against_the_api_schemas(overlay: str) -> None:
    import jsonschema
    import kubernetes_validate

    rendered = render(overlay)
    assert rendered
    for obj in rendered:
        crd = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
        if crd is not None:
            jsonschema.validate(obj, json.loads((SCHEMAS_DIR / crd).read_text()))
            for template in obj["spec"].get("leaderWorkerTemplate", {}).values():
                if isinstance(template, dict):  # a core PodTemplateSpec
                    kubernetes_validate.validate(
                        {
                            "apiVersion": "v1",
                            "kind": "PodTemplate",
                            "metadata": {"name": "t"},
                            "template": template,
                        },
                        KUBERNETES_VERSION,
                        strict=True,
                    )
        else:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_the_validation_refuses_a_misspelt_field() -> None:
    import kubernetes_validate

    (router,) = [obj for obj in workloads("overlays/cpu") if component(obj) == "router"]
    broken = json.loads(json.dumps(router))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["comand"] = ["x"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


@functools.cache
def _flag_actions(module: str) -> dict[str, Any]:
    from pagemesh.runtime.config import env_name

    parser = command_parser(["python", "-m", module])
    return {
        env_name(a.option_strings[0]): a
        for a in parser._actions
        if a.option_strings and a.dest != "help"
    }


@functools.cache
def _flag_variables(module: str) -> set[str]:
    """Every variable the service reads: each flag's, and its `_FILE` form."""
    return flag_variables(command_parser(["python", "-m", module]))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pagemesh_variable_is_a_flag_of_its_service(overlay: str) -> None:
    seen = set()
    for obj in workloads(overlay):
        for container in obj["spec"]["template"]["spec"]["containers"]:
            module = service_module(container)
            if module is None:
                continue
            seen.add(module)
            actions = _flag_actions(module)
            for name, value in container_env(overlay, container).items():
                if not name.startswith("PAGEMESH_"):
                    continue
                assert name in _flag_variables(module), (
                    f"{obj['metadata']['name']}: {module} takes no {name}"
                )
                if name not in actions:  # <FLAG>_FILE: the file holding the flag's value
                    assert value is None or value.startswith("/"), (name, value)
                    continue
                action = actions[name]
                if value is None:
                    continue
                if action.type is None:  # --flag/--no-flag
                    _parse_bool(value)
                else:
                    parsed = action.type(value)
                    assert action.choices is None or parsed in action.choices, (name, value)
    assert seen == SERVICE_MODULES


# --- docs/kubernetes.md -------------------------------------------------------------------


def test_the_doc_names_files_and_objects_that_exist() -> None:
    doc = (REPO_ROOT / "docs" / "kubernetes.md").read_text()
    for path in set(re.findall(r"\b((?:deploy|compose|docs|tests)/[\w./-]*\w)", doc)):
        if path.startswith("deploy/pagemesh-"):  # kubectl's deploy/<name>
            continue
        assert (REPO_ROOT / path).exists(), path
    names = {obj["metadata"]["name"] for obj in render("overlays/gpu")}
    names |= {name.rsplit("-", 1)[0] for name in names}  # generated ConfigMaps' hash suffix
    for kind_name in set(re.findall(r"\b(?:deploy|sts|svc)/(pagemesh-[\w-]+)", doc)):
        assert kind_name in names or kind_name.endswith("-g2"), kind_name  # g2: the added group
    for variable in set(re.findall(r"\b(PAGEMESH_[A-Z_]+)", doc)):
        assert any(variable in _flag_variables(module) for module in SERVICE_MODULES), variable
