"""Flower's message internals dpfl reads or writes (flwr 1.41 private APIs).

* :func:`content_bytes`, :func:`record_dict_bytes`: a message's (a content's) serialised size, from
  its nested objects as Flower sends them
  (``flwr.supercore.inflatable.inflatable_object.get_all_nested_objects``, chunks of at most
  :data:`MAX_ARRAY_CHUNK_BYTES`);
* :func:`set_message_id`, :func:`set_reply_source`: ``Metadata`` has no setters for a reply's id and
  sender; Flower's own worker sets the attribute directly, and so do these;
* :func:`client_app_error`: the error code and reason Flower's worker gives a message whose
  ClientApp raised;
* :func:`log_client_error`: a failing client's error and traceback, logged as Flower's worker logs them;
* :func:`member_message`: a message built on the client side from another's metadata (a cohort
  message's member, :mod:`fl_app.engine.packed`; ``flwr.app.message.message.make_message``);
* :func:`task_identity`: messages built outside a run (tests, benchmarks) need the process's task
  identity that a ServerApp or ClientApp process has (``flwr.supercore.task_identity``);
* :func:`over_the_wire`, :func:`stored_context`, :func:`restored_context`: a message as the other side
  of a deployment reads it, and a node's Context as a SuperNode keeps it between ClientApp processes
  (Flower's protobuf, ``flwr.common.serde`` and ``flwr.proto``): tests answer devices in process so.

:class:`Broadcast` is the messages of one content to many nodes, built only when someone reads them (the
engine reads the content and the node ids: a cohort packed or sent in bulk builds no message per client).

:func:`config_record` uses only the public ``Mapping`` API of a ``RecordDict``; it lives here with the
other message helpers of the per-message path.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from typing import overload

from flwr.app import Context, Message, RecordDict
from flwr.app.message.message import make_message
from flwr.common.constant import FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE, SUPERLINK_NODE_ID
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.task_identity import TaskIdentity

#: Flower sends an array's data in chunks of at most this many bytes (each its own object).
MAX_ARRAY_CHUNK_BYTES: int = FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE
#: The sender of the error replies the SuperLink writes itself (a node that is gone).
LINK_NODE_ID: int = SUPERLINK_NODE_ID


def content_bytes(message: Message) -> int:
    """Serialised size of a message's content (0 for error replies)."""
    return record_dict_bytes(message.content) if message.has_content() else 0


def record_dict_bytes(content: RecordDict) -> int:
    """Serialised size of a message content: the sum of its distinct nested objects as Flower sends them."""
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(content).values())


def client_app_error(ex: BaseException) -> tuple[int, str]:
    """The error code and reason Flower's worker gives a message whose processing raised ``ex``."""
    from flwr.clientapp.client_app import ClientAppException, LoadClientAppError
    from flwr.common.constant import ErrorCode

    if isinstance(ex, ClientAppException):
        code = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    elif isinstance(ex, LoadClientAppError):
        code = ErrorCode.LOAD_CLIENT_APP_EXCEPTION
    else:
        code = ErrorCode.UNKNOWN
    return int(code), str(type(ex)) + ":<'" + str(ex) + "'>"


def raised_in_client_app(ex: BaseException) -> tuple[int, str]:
    """The error code and reason of a message whose ClientApp raised ``ex`` (the engine wraps it first)."""
    from flwr.clientapp.client_app import ClientAppException

    return client_app_error(ClientAppException(str(ex)))


def log_client_error(reason: str, remote_traceback: str) -> None:
    """Log a failing client's error and traceback, as Flower's worker does, on the engine's behalf.

    Logged from this seam, so ``run.log`` withholds them when the cohort is secret
    (:class:`fl_app.run.log.PublishedLogFilter`: their number and timing follow the cohort).
    """
    from logging import ERROR

    from flwr.common import log

    log(ERROR, reason)
    log(ERROR, remote_traceback)


def set_message_id(message: Message, message_id: str) -> None:
    """Give a reply built outside Flower's worker its own message id (as the worker does)."""
    message.metadata.__dict__["_message_id"] = message_id


def set_reply_source(reply: Message, node_id: int) -> None:
    """Credit a reply to ``node_id`` (the SuperLink's error reply for a node that is gone)."""
    reply.metadata.__dict__["_src_node_id"] = node_id


def member_message(message: Message, *, node_id: int, message_id: str, content: RecordDict) -> Message:
    """A message as ``message`` but for node ``node_id``, with its own id and ``content``.

    What a client of a packed message receives (:mod:`fl_app.engine.packed`): the metadata of the
    message that reached the node (run, sender, round type, deadline), addressed to the member.
    """
    metadata = copy.copy(message.metadata)
    metadata.__dict__["_dst_node_id"] = int(node_id)
    metadata.__dict__["_message_id"] = message_id
    return make_message(metadata, content)


class Broadcast(Sequence[Message]):
    """The messages of type ``message_type`` with one ``content`` to each of ``node_ids``, in order.

    A sequence of Flower ``Message`` objects, built on the first read (then the same objects each
    time: Flower sets their ids when it pushes them). The engine reads :attr:`content` and
    :attr:`node_ids` instead, so a round it packs or sends in bulk builds none per client.
    """

    def __init__(self, content: RecordDict, node_ids: Sequence[int], message_type: str) -> None:
        self.content = content
        self.node_ids = [int(node) for node in node_ids]
        self.message_type = message_type
        self._messages: list[Message] | None = None

    def _built(self) -> list[Message]:
        if self._messages is None:
            self._messages = [
                Message(content=self.content, dst_node_id=node, message_type=self.message_type)
                for node in self.node_ids
            ]
        return self._messages

    def __len__(self) -> int:
        return len(self.node_ids)

    @overload
    def __getitem__(self, index: int) -> Message: ...
    @overload
    def __getitem__(self, index: slice) -> list[Message]: ...
    def __getitem__(self, index: int | slice) -> Message | list[Message]:
        return self._built()[index]

    def __iter__(self) -> Iterator[Message]:
        return iter(self._built())

    def to(self, node_ids: Sequence[int]) -> Broadcast:
        """The same content to ``node_ids`` (a share of the nodes), built on its own first read."""
        return Broadcast(self.content, node_ids, self.message_type)


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


def over_the_wire(message: Message) -> Message:
    """``message`` as the other side of a deployment reads it: Flower's protobuf, serialized and parsed."""
    from flwr.common.serde import message_from_proto, message_to_proto
    from flwr.proto.message_pb2 import Message as ProtoMessage

    return message_from_proto(ProtoMessage.FromString(message_to_proto(message).SerializeToString()))


def stored_context(context: Context) -> bytes:
    """A node's Context as Flower's protobuf (what a SuperNode keeps between ClientApp processes)."""
    from flwr.common.serde import context_to_proto

    return context_to_proto(context).SerializeToString()


def restored_context(stored: bytes) -> Context:
    """The Context :func:`stored_context` stored, as the next ClientApp process receives it."""
    from flwr.common.serde import context_from_proto
    from flwr.proto.message_pb2 import Context as ProtoContext

    return context_from_proto(ProtoContext.FromString(stored))
