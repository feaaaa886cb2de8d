"""Flower's message internals dpfl reads or writes (flwr 1.41 private APIs).

* :func:`content_bytes`: a message's serialised size, from its nested objects as Flower sends them
  (``flwr.supercore.inflatable.inflatable_object.get_all_nested_objects``, chunks of at most
  :data:`MAX_ARRAY_CHUNK_BYTES`);
* :func:`set_message_id`, :func:`set_reply_source`: ``Metadata`` has no setters for a reply's id and
  sender; Flower's own worker sets the attribute directly, and so do these;
* :func:`task_identity`: messages built outside a run (tests, benchmarks) need the process's task
  identity that a ServerApp or ClientApp process has (``flwr.supercore.task_identity``).

:func:`config_record` uses only the public ``Mapping`` API of a ``RecordDict``; it lives here with the
other message helpers of the per-message path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.constant import FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE, SUPERLINK_NODE_ID
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.task_identity import TaskIdentity

#: Flower sends an array's data in chunks of at most this many bytes (each its own object).
MAX_ARRAY_CHUNK_BYTES: int = FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE
#: The sender of the error replies the SuperLink writes itself (a node that is gone).
LINK_NODE_ID: int = SUPERLINK_NODE_ID


def config_record(content: RecordDict, name: str) -> ConfigRecord | None:
    """The ConfigRecord ``name`` of a message's content, or None when it has none of that name.

    One dictionary lookup: Flower's ``content.config_records`` builds a new synchronised view of every
    record on each access (about 7 us here), and a train message's path read it six times.
    """
    record = content.get(name)
    return record if isinstance(record, ConfigRecord) else None


def content_bytes(message: Message) -> int:
    """Serialised size of a message's content (0 for error replies)."""
    if not message.has_content():
        return 0
    objects = get_all_nested_objects(message.content)
    return sum(len(obj.deflate()) for obj in objects.values())


def set_message_id(message: Message, message_id: str) -> None:
    """Give a reply built outside Flower's worker its own message id (as the worker does)."""
    message.metadata.__dict__["_message_id"] = message_id


def set_reply_source(reply: Message, node_id: int) -> None:
    """Credit a reply to ``node_id`` (the SuperLink's error reply for a node that is gone)."""
    reply.metadata.__dict__["_src_node_id"] = node_id


@contextlib.contextmanager
def task_identity(*, run_id: int, node_id: int = 0, task_id: int = 1) -> Iterator[None]:
    """Inside: messages can be built as in a run ``run_id`` of node ``node_id``; the identity is restored."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, node_id, task_id
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def set_task_identity(*, run_id: int, node_id: int = 0, task_id: int = 1) -> None:
    """Set the process's task identity for good (a benchmark's process builds messages outside a run)."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, node_id, task_id
