"""What the nodes' ``validate_inputs`` share: the host's verdict form, which inputs are linked, the files a
combo names, and the host's own type check for linked inputs (a node that asks for ``input_types`` takes that
check over from the host)."""

from __future__ import annotations

from typing import Callable

from ..h3_core.errors import H3InputError
from ..h3_core.formats.file_kinds import check_file
from . import _host


def verdict(*checks: Callable[[], object]) -> bool | str:
    """``True`` when every check passes; otherwise the message of the first ``H3InputError`` (the host shows a
    string as the node's validation error, naming the node)."""
    try:
        for check in checks:
            check()
    except H3InputError as exc:
        return str(exc)
    return True


def linked(input_types, name: str) -> bool:
    """Whether input ``name`` is connected (the host's ``input_types``: linked inputs by name)."""
    return isinstance(input_types, dict) and name in input_types


def check_linked_types(node_cls, input_types) -> None:
    """The host's own type check (``comfy_execution.validation.validate_node_input``) for every linked input."""
    from comfy_execution.validation import validate_node_input

    if not isinstance(input_types, dict):
        return
    declared = {}
    for section in ("required", "optional"):
        declared.update(node_cls.INPUT_TYPES().get(section, {}))
    for name, received in input_types.items():
        if name in declared and not validate_node_input(received, declared[name][0]):
            raise H3InputError(f"{name}: takes {declared[name][0]}, but a {received} output is connected")


def check_choice(name: str, value, allowed) -> None:
    """``value`` one of ``allowed`` (None: linked, known only at execution)."""
    if value is not None and value not in allowed:
        raise H3InputError(f"{name}: must be one of {list(allowed)}, got {value!r}")


def check_model_file(folder: str, name, input_name: str, kind: str) -> str | None:
    """The file ``name`` of the host's ``folder`` read as ``kind`` from its header: its summary, or an error
    naming the input, the file and what it is (None: linked, known only at execution)."""
    if name is None:
        return None
    return check_path(_host.model_path(folder, name, input_name), kind, input_name)


def check_path(path, kind: str, input_name: str) -> str:
    """``path`` read as ``kind`` from its header (``h3_core.formats.file_kinds.check_file``)."""
    return check_file(path, kind, input_name)


def check_host_room(input_name: str, path, need_bytes: int, available_bytes: int) -> None:
    """Refuse, before reading, a file whose weights would not fit the host memory available (``psutil``'s
    ``available``: free memory plus what the system can reclaim), naming the file and both amounts."""
    if need_bytes > available_bytes:
        gib = 2**30
        raise H3InputError(
            f"{input_name}: {path.name} needs about {need_bytes / gib:.1f} GiB of host memory to load, and "
            f"{available_bytes / gib:.1f} GiB is available; close other programs, unload other models, or choose "
            "a smaller form of the file (fp8, int8)"
        )
