"""MkDocs hook: generates the gRPC API reference page from the commented .proto files.

mkdocs.yml lists it (`hooks: [docs/_hooks/generate.py]`). At each build `on_files` asks protoc
(grpc_tools) for the descriptors of every .proto under protos/pagemesh, with their source
info (the comments, by path), and adds `reference/grpc.md` as an in-memory page: nothing
generated is committed, and the page cannot go stale. It also keeps this folder and
docs/_tools/ out of the built site.

`render_reference()` is the generator; tests/docs/test_proto_reference.py calls it directly.
`python docs/_hooks/generate.py [OUT.md]` prints (or writes) the page.
"""

from __future__ import annotations

import html
import re
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PAGE_URI = "reference/grpc.md"
PUBLIC_PACKAGE = "pagemesh.v1"
# Public API first, in this order; every other .proto follows, sorted by path.
FIRST_FILES = ("protos/pagemesh/v1/generate.proto", "protos/pagemesh/v1/admin.proto")
NOT_IN_SITE = ("_hooks/", "_tools/")

# descriptor.proto field numbers that make up source_code_info paths.
FILE_MESSAGE, FILE_ENUM, FILE_SERVICE, FILE_SYNTAX, FILE_PACKAGE = 4, 5, 6, 12, 2
MESSAGE_FIELD, MESSAGE_NESTED, MESSAGE_ENUM, MESSAGE_ONEOF = 2, 3, 4, 8
ENUM_VALUE, SERVICE_METHOD = 2, 2

_LABEL_REPEATED = 3


def proto_files(repo_root: Path = REPO_ROOT) -> list[str]:
    """Every .proto under protos/pagemesh, as include-root-relative paths, public ones first."""
    found = sorted(
        p.relative_to(repo_root).as_posix()
        for p in (repo_root / "protos" / "pagemesh").rglob("*.proto")
    )
    return [f for f in FIRST_FILES if f in found] + [f for f in found if f not in FIRST_FILES]


def load_descriptors(repo_root: Path = REPO_ROOT):
    """protoc's FileDescriptorSet of `proto_files()`, with source info (comments and spans)."""
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    names = proto_files(repo_root)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "descriptors.pb"
        args = [
            "protoc",
            f"-I{repo_root}",
            f"-I{Path(protoc.__file__).parent / '_proto'}",
            "--include_source_info",
            f"--descriptor_set_out={out}",
            *names,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        descriptors = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    by_name = {f.name: f for f in descriptors.file}
    return [by_name[n] for n in names]


class _Comments:
    """A file's comments and spans by source path. protoc attaches a comment block to the
    first element of a group only: an uncommented element right below a commented sibling
    (no blank line between) shares its comment, except a field of a message or enum type,
    whose type names it well enough (`dtype`'s comment is not `layout`'s)."""

    def __init__(self, file) -> None:
        self._locations = {tuple(loc.path): loc for loc in file.source_code_info.location}

    def of(self, path: tuple[int, ...]) -> str:
        loc = self._locations.get(path)
        if loc is None:
            return ""
        parts = [loc.leading_comments.strip(), loc.trailing_comments.strip()]
        return "\n".join(p for p in parts if p)

    def shares_previous(self, path: tuple[int, ...]) -> bool:
        if self.of(path) or path[-1] == 0:
            return False
        prev = path[:-1] + (path[-1] - 1,)
        here, before = self._locations.get(path), self._locations.get(prev)
        if here is None or before is None:
            return False
        end_line = before.span[2] if len(before.span) == 4 else before.span[0]
        return end_line + 1 == here.span[0] and (bool(self.of(prev)) or self.shares_previous(prev))

    def cell(self, path: tuple[int, ...], *, shareable: bool = True) -> str:
        if shareable and self.shares_previous(path):
            return "*as above*"
        return _md(self.of(path), in_table=True)


_CODE_SPAN = re.compile(r"(`[^`]*`)")


def _md(comment: str, *, in_table: bool = False) -> str:
    """A comment as Markdown: literal outside code spans, lines joined into paragraphs."""
    paragraphs = [
        " ".join(line.strip() for line in block.splitlines())
        for block in re.split(r"\n\s*\n", comment.strip())
        if block.strip()
    ]
    out = []
    for text in paragraphs:
        pieces = _CODE_SPAN.split(text)
        for i in range(0, len(pieces), 2):  # even pieces are outside code spans
            piece = html.escape(pieces[i], quote=False)
            pieces[i] = re.sub(r"([\\*_\[\]|#])", r"\\\1", piece)
        out.append("".join(pieces))
    return ("<br><br>" if in_table else "\n\n").join(out)


def _anchor(full_name: str) -> str:
    return full_name.lstrip(".")


class _Renderer:
    def __init__(self, files) -> None:
        self.files = files
        self.known: set[str] = set()  # full names (no leading dot) of documented types
        for f in files:
            for name, _, _ in self._types(f):
                self.known.add(name)
        self.lines: list[str] = []

    def _types(self, file):
        """(full name, descriptor, source path) of every message and enum, nested ones after
        their parent; map entries are left out (they read as `map<K, V>`)."""

        def walk(prefix, messages, enums, path, msg_tag, enum_tag):
            for i, m in enumerate(messages):
                if m.options.map_entry:
                    continue
                name, p = f"{prefix}.{m.name}", path + (msg_tag, i)
                yield name, m, p
                yield from walk(name, m.nested_type, m.enum_type, p, MESSAGE_NESTED, MESSAGE_ENUM)
            for i, e in enumerate(enums):
                yield f"{prefix}.{e.name}", e, path + (enum_tag, i)

        yield from walk(
            file.package, file.message_type, file.enum_type, (), FILE_MESSAGE, FILE_ENUM
        )

    def type_ref(self, type_name: str, package: str) -> str:
        name = _anchor(type_name)
        shown = name[len(package) + 1 :] if name.startswith(package + ".") else name
        if name in self.known:
            return f"[`{shown}`](#{name})"
        return f"`{shown}`"

    def field_type(self, field, message, package: str) -> str:
        from google.protobuf.descriptor_pb2 import FieldDescriptorProto as F

        if field.type in (F.TYPE_MESSAGE, F.TYPE_ENUM):
            entry = next(
                (
                    n
                    for n in message.nested_type
                    if n.options.map_entry and field.type_name.endswith("." + n.name)
                ),
                None,
            )
            if entry is not None:
                key, value = (self.field_type(f, entry, package) for f in entry.field)
                return f"map<{key}, {value}>".replace("<", "&lt;").replace(">", "&gt;")
            base = self.type_ref(field.type_name, package)
        else:
            base = f"`{F.Type.Name(field.type)[len('TYPE_') :].lower()}`"
        if field.label == _LABEL_REPEATED:
            return f"repeated {base}"
        if field.proto3_optional:
            return f"optional {base}"
        if field.HasField("oneof_index"):
            return f"{base} (oneof `{message.oneof_decl[field.oneof_index].name}`)"
        return base

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def heading(self, level: int, text: str, anchor: str) -> None:
        self.add(f'<a id="{anchor}"></a>', "", f"{'#' * level} {text}", "")

    def file(self, file) -> None:
        comments = _Comments(file)
        pkg = file.package
        self.add(
            f"### `{Path(file.name).name}` — package `{pkg}`", "", f"Source: `{file.name}`", ""
        )
        intro = comments.of((FILE_SYNTAX,)) or comments.of((FILE_PACKAGE,))
        if intro:
            self.add(_md(intro), "")
        for s_i, service in enumerate(file.service):
            self.service(service, pkg, comments, (FILE_SERVICE, s_i))
        for name, desc, path in self._types(file):
            if hasattr(desc, "value"):
                self.enum(name, desc, comments, path)
            else:
                self.message(name, desc, pkg, comments, path)

    def service(self, service, pkg, comments, path) -> None:
        full = f"{pkg}.{service.name}"
        self.heading(4, f"service `{service.name}`", full)
        if comments.of(path):
            self.add(_md(comments.of(path)), "")
        self.add("| RPC | Request | Response | Description |", "| --- | --- | --- | --- |")
        for m_i, method in enumerate(service.method):
            stream_in = "stream " if method.client_streaming else ""
            stream_out = "stream " if method.server_streaming else ""
            self.add(
                f'| <a id="{full}.{method.name}"></a>`{method.name}` '
                f"| {stream_in}{self.type_ref(method.input_type, pkg)} "
                f"| {stream_out}{self.type_ref(method.output_type, pkg)} "
                f"| {comments.cell(path + (SERVICE_METHOD, m_i))} |"
            )
        self.add("")

    def message(self, name, message, pkg, comments, path) -> None:
        self.heading(4, f"`{name[len(pkg) + 1 :]}`", name)
        if comments.of(path):
            self.add(_md(comments.of(path)), "")
        if not message.field:
            self.add("No fields.", "")
            return
        self.add("| Field | Type | Number | Description |", "| --- | --- | ---: | --- |")
        for f_i, field in enumerate(message.field):
            scalar = not field.type_name  # set for message and enum types only
            cell = comments.cell(path + (MESSAGE_FIELD, f_i), shareable=scalar)
            self.add(
                f"| `{field.name}` | {self.field_type(field, message, pkg)} "
                f"| {field.number} | {cell} |"
            )
        self.add("")
        for o_i, oneof in enumerate(message.oneof_decl):
            members = [
                f"`{f.name}`"
                for f in message.field
                if f.HasField("oneof_index") and f.oneof_index == o_i
            ]
            if oneof.name.startswith("_") and len(members) == 1:
                continue  # the synthetic oneof of a proto3 `optional` field
            text = comments.of(path + (MESSAGE_ONEOF, o_i))
            self.add(
                f"oneof `{oneof.name}`: at most one of {', '.join(members)} is set."
                + (f" {_md(text)}" if text else ""),
                "",
            )

    def enum(self, name, enum, comments, path) -> None:
        pkg_len = len(name) - len(name.split(".")[-1])
        self.heading(4, f"enum `{name[pkg_len:]}`", name)
        if comments.of(path):
            self.add(_md(comments.of(path)), "")
        self.add("| Value | Number | Description |", "| --- | ---: | --- |")
        for v_i, value in enumerate(enum.value):
            self.add(
                f"| `{value.name}` | {value.number} | {comments.cell(path + (ENUM_VALUE, v_i))} |"
            )
        self.add("")


def render_reference(repo_root: Path = REPO_ROOT) -> str:
    """The Markdown of the gRPC API reference page; the same protos give the same text."""
    files = load_descriptors(repo_root)
    r = _Renderer(files)
    r.add(
        "# gRPC API reference",
        "",
        "Generated at each docs build by `docs/_hooks/generate.py` from protoc's descriptors "
        "of `protos/pagemesh/**/*.proto`, comments included: edit the `.proto` files, not "
        "this page. A cell reading *as above* shares the comment of the line above it in "
        "the `.proto`.",
        "",
    )
    public = [f for f in files if f.package == PUBLIC_PACKAGE]
    internal = [f for f in files if f.package != PUBLIC_PACKAGE]
    r.add("## Public API", "", f"Package `{PUBLIC_PACKAGE}`, served by the router.", "")
    for f in public:
        r.file(f)
    if internal:
        r.add(
            "## Internal API",
            "",
            "> **Internal.** These services run between the router, the schedulers and the "
            "workers of one mesh; they are not a client API and change without notice. "
            "Schedulers and workers answer only calls that carry the mesh's internal token.",
            "",
        )
        for f in internal:
            r.file(f)
    return "\n".join(r.lines).rstrip() + "\n"


# --- MkDocs hook ---------------------------------------------------------------------------


def on_files(files, config):
    from mkdocs.structure.files import File

    for f in list(files):
        if f.src_uri.startswith(NOT_IN_SITE) or "__pycache__" in f.src_uri or f.src_uri == PAGE_URI:
            files.remove(f)
    files.append(File.generated(config, PAGE_URI, content=render_reference()))
    return files


def on_serve(server, config, builder):
    """`mkdocs serve` rebuilds the page when a .proto changes."""
    server.watch(str(REPO_ROOT / "protos" / "pagemesh"))
    return server


if __name__ == "__main__":
    text = render_reference()
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(text)
    else:
        sys.stdout.write(text)
