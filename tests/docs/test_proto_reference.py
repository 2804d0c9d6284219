"""The gRPC reference page (docs/_hooks/generate.py) carries every RPC and field of the public
API with the comment protoc reports for it, and links only to anchors it defines."""

from __future__ import annotations

import html
import importlib.util
import re
from pathlib import Path

import pytest

from protos.codegen import PROTO_FILES
from protos.pagemesh.v1 import generate_pb2

HOOK = Path(__file__).resolve().parents[2] / "docs" / "_hooks" / "generate.py"


@pytest.fixture(scope="module")
def hook():
    spec = importlib.util.spec_from_file_location("docs_generate_hook", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def page(hook) -> str:
    return hook.render_reference()


@pytest.fixture(scope="module")
def generate_proto(hook):
    return next(f for f in hook.load_descriptors() if f.name.endswith("v1/generate.proto"))


def _comment(file, path: tuple[int, ...]) -> str:
    """protoc's comment for `path`, whitespace collapsed (as the page shows it)."""
    for loc in file.source_code_info.location:
        if tuple(loc.path) == path:
            text = " ".join([loc.leading_comments, loc.trailing_comments])
            return " ".join(text.split())
    return ""


def _row(page: str, section_anchor: str, first_cell: str) -> str:
    """The table row of `section_anchor`'s section whose first cell names `first_cell`, as
    plain text (Markdown escapes and HTML entities undone)."""
    section = page.split(f'<a id="{section_anchor}"></a>', 1)[1].split("\n#### ", 2)[1]
    rows = [
        line
        for line in section.splitlines()
        if re.match(rf"\| (<a id=\"[^\"]+\"></a>)?`{first_cell}` \|", line)
    ]
    assert len(rows) == 1, f"{section_anchor}: no single row for {first_cell}"
    return html.unescape(re.sub(r"\\(.)", r"\1", rows[0]))


def test_every_rpc_of_generate_proto_with_its_comment(page, generate_proto):
    service = generate_pb2.DESCRIPTOR.services_by_name["Generation"]
    assert [m.name for m in service.methods] == [m.name for m in generate_proto.service[0].method]
    for i, method in enumerate(service.methods):
        row = _row(page, "pagemesh.v1.Generation", method.name)
        comment = _comment(generate_proto, (6, 0, 2, i))
        assert comment and comment in row, method.name
        assert f"[`{method.input_type.name}`](#{method.input_type.full_name})" in row
        streams = "stream " if method.server_streaming else ""
        assert f"| {streams}[`{method.output_type.name}`]" in row
    assert '<a id="pagemesh.v1.Generation.Generate"></a>' in page


def test_every_field_of_generate_request_with_its_comment(page, generate_proto):
    request = generate_pb2.GenerateRequest.DESCRIPTOR
    index = [m.name for m in generate_proto.message_type].index("GenerateRequest")
    assert [f.name for f in generate_proto.message_type[index].field] == [
        f.name for f in request.fields
    ]
    for i, field in enumerate(request.fields):
        row = _row(page, "pagemesh.v1.GenerateRequest", field.name)
        assert f"| {field.number} |" in row
        comment = _comment(generate_proto, (4, index, 2, i))
        assert comment and comment in row, field.name
    assert "(oneof `prompt`)" in _row(page, "pagemesh.v1.GenerateRequest", "token_ids")
    assert "Prompt token ids." in _row(page, "pagemesh.v1.GenerateRequest", "token_ids")


def test_links_resolve_and_page_is_deterministic(hook, page):
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', page))
    assert len(anchors) == len(re.findall(r'<a id="', page)), "duplicate anchors"
    targets = set(re.findall(r"\]\(#([^)]+)\)", page))
    assert targets and targets <= anchors, targets - anchors
    assert (
        page.index("## Public API")
        < page.index("generate.proto")
        < page.index("admin.proto")
        < page.index("## Internal API")
        < page.index("scheduler.proto")
    )
    assert hook.render_reference() == page


def _documented_elements(file):
    """(source path, name) of every message (nested ones too), field, enum, enum value,
    service and RPC of `file`; map entries are left out (their fields are the map's)."""

    def message(m, path, name):
        yield path, f"message {name}"
        for i, field in enumerate(m.field):
            yield path + (2, i), f"field {name}.{field.name}"
        for i, nested in enumerate(m.nested_type):
            if not nested.options.map_entry:
                yield from message(nested, path + (3, i), f"{name}.{nested.name}")
        for i, e in enumerate(m.enum_type):
            yield from enum(e, path + (4, i), f"{name}.{e.name}")

    def enum(e, path, name):
        yield path, f"enum {name}"
        for i, value in enumerate(e.value):
            yield path + (2, i), f"value {name}.{value.name}"

    for i, m in enumerate(file.message_type):
        yield from message(m, (4, i), m.name)
    for i, e in enumerate(file.enum_type):
        yield from enum(e, (5, i), e.name)
    for i, service in enumerate(file.service):
        yield (6, i), f"service {service.name}"
        for j, method in enumerate(service.method):
            yield (6, i, 2, j), f"rpc {service.name}.{method.name}"


def test_every_element_of_every_proto_has_its_own_comment(hook):
    """STYLE.md: every field says what it is and its unit. A comment above a group of fields
    is protoc's for the first one only, so each element needs a comment of its own."""
    files = hook.load_descriptors()
    assert sorted(f.name for f in files) == sorted(PROTO_FILES)
    missing = []
    for file in files:
        elements = list(_documented_elements(file))
        assert any(path[0] == 4 for path, _ in elements), file.name
        missing += [f"{file.name}: {name}" for path, name in elements if not _comment(file, path)]
    assert not missing, "uncommented:\n" + "\n".join(missing)
