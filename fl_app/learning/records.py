"""One-lookup accessors of a message's records (Flower's public API: ``RecordDict.get``).

Flower's ``content.config_records`` (and ``array_records``, ``metric_records``) builds a new view of
every record on each access; these read one record by name in one dictionary lookup.
"""

from __future__ import annotations

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict


def config_record(content: RecordDict, name: str) -> ConfigRecord | None:
    """The ConfigRecord ``name`` of a message's content, or None when it has none of that name.

    One dictionary lookup: Flower's ``content.config_records`` builds a new synchronised view of every
    record on each access (about 7 us here), and a train message's path read it six times.
    """
    record = content.get(name)
    return record if isinstance(record, ConfigRecord) else None


def array_record(content: RecordDict, name: str) -> ArrayRecord | None:
    """The ArrayRecord ``name`` of a message's content, or None (one lookup, as :func:`config_record`)."""
    record = content.get(name)
    return record if isinstance(record, ArrayRecord) else None


def metric_record(content: RecordDict, name: str) -> MetricRecord | None:
    """The MetricRecord ``name`` of a message's content, or None (one lookup, as :func:`config_record`)."""
    record = content.get(name)
    return record if isinstance(record, MetricRecord) else None
