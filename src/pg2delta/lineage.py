"""OpenLineage events of the commands that write: ``run``, ``bootstrap``, ``resync``, ``backfill``, ``maintain``.

Each emits START when it begins, then COMPLETE or FAIL, through the ``openlineage-python`` client
(``pip install 'pg2delta[lineage]'``), configured the standard OpenLineage way: an
``openlineage.yml`` (``OPENLINEAGE_CONFIG``, the working directory, ``~/.openlineage/``),
``OPENLINEAGE__TRANSPORT__*`` variables, or ``OPENLINEAGE_URL``. Nothing of it is set: no events
(the client alone would print them to the console). ``OPENLINEAGE_DISABLED=true`` turns it off.

- The job: namespace ``OPENLINEAGE_NAMESPACE`` (default ``pg2delta``), name ``<slot>.<command>``.
  ``OPENLINEAGE_PARENT_ID`` (``namespace/job/run_id``, as Airflow's ``lineage_parent_id`` macro
  renders it) makes the run a child of the scheduler's task.
- Inputs: the PostgreSQL tables, named as OpenLineage's naming spec says
  (``postgres://host:port``, ``database.schema.table``).
- Outputs: the Delta tables (``file`` and the path, or ``s3://bucket`` and the key), with their
  schema (read from the Delta log) and the rows the command wrote (``outputStatistics``).
- A run facet ``pg2delta``: the slot and the LSN range the command covered.

Lineage never fails a command: an event that cannot be built or sent is a warning in the log.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from pg2delta import __version__

log = logging.getLogger(__name__)

WRITING_COMMANDS = ("run", "bootstrap", "resync", "backfill", "maintain")
PRODUCER = "https://github.com/pg2delta/pg2delta"
_FACET_SCHEMA = "https://github.com/pg2delta/pg2delta/blob/main/docs/operations/lineage.md#the-pg2delta-run-facet"


@dataclass
class Outcome:
    """What a finished command wrote, for COMPLETE: per table ``schema.table``, the rows written."""

    slot: str
    tables: dict[str, int] = field(default_factory=dict)
    from_lsn: str | None = None
    to_lsn: str | None = None


def outcome_of(command: str, slot: str, summary: dict[str, Any], table_uri: Any) -> tuple[Outcome, dict[str, str]]:
    """The :class:`Outcome` of a command's JSON report ``summary`` (the one ``--json`` prints), and
    the Delta table each of its tables was written to (``table_uri(schema, table)`` in the lake,
    a backfill's own path where it has one)."""
    tables: dict[str, int] = {}
    uris: dict[str, str] = {}
    for name, t in (summary.get("tables") or {}).items():
        if command == "maintain":
            rows = 0  # compaction and VACUUM rewrite files, not rows
            parts = name.split("/") if "/" in name else name.split(".", 1)
        else:
            rows = int(t.get("rows", 0)) + sum(int(t.get(k, 0)) for k in ("inserts", "updates", "deletes"))
            parts = name.split(".", 1)
        tables[name] = rows
        uris[name] = t.get("path") or table_uri(*parts)
    outcome = Outcome(slot=slot, tables=tables, from_lsn=summary.get("from_lsn") or summary.get("start_lsn"),
                      to_lsn=summary.get("to_lsn"))
    return outcome, uris


def _configured() -> bool:
    """Whether the user configured an OpenLineage transport (see the module's docstring)."""
    if os.getenv("OPENLINEAGE_DISABLED", "").strip().lower() == "true":
        return False
    if os.getenv("OPENLINEAGE_URL") or any(k.startswith("OPENLINEAGE__TRANSPORT") for k in os.environ):
        return True
    places = [os.getenv("OPENLINEAGE_CONFIG"), "openlineage.yml", os.path.expanduser("~/.openlineage/openlineage.yml")]
    return any(p and os.path.isfile(p) for p in places)


def postgres_dataset(dsn: str, qualified: str) -> tuple[str, str]:
    """(namespace, name) of the PostgreSQL table ``qualified`` (``schema.table``) of ``dsn``."""
    from psycopg.conninfo import conninfo_to_dict

    info = conninfo_to_dict(dsn)
    host = str(info.get("host") or os.getenv("PGHOST") or "localhost").split(",")[0]
    port = str(info.get("port") or os.getenv("PGPORT") or "5432").split(",")[0]
    database = str(info.get("dbname") or os.getenv("PGDATABASE") or info.get("user") or "postgres")
    return f"postgres://{host}:{port}", f"{database}.{qualified}"


def delta_dataset(uri: str) -> tuple[str, str]:
    """(namespace, name) of the Delta table at ``uri``: ``file`` and its path, or the bucket and key."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return "file", os.path.abspath(parsed.path if parsed.scheme else uri)
    return f"{parsed.scheme}://{parsed.netloc}", parsed.path.lstrip("/")


class Lineage:
    """One command's events (START, then COMPLETE or FAIL), or nothing when lineage is off."""

    def __init__(self, command: str, slot: str, client: Any) -> None:
        from openlineage.client.uuid import generate_new_uuid

        self.command, self.slot, self.client = command, slot, client
        self.run_id = str(generate_new_uuid())
        self.namespace = os.getenv("OPENLINEAGE_NAMESPACE") or "pg2delta"

    @classmethod
    def start(cls, command: str, slot: str) -> Lineage | None:
        """START emitted for ``command`` on ``slot``; None when lineage is off or not installed."""
        if command not in WRITING_COMMANDS or not _configured():
            return None
        try:
            from openlineage.client import OpenLineageClient
        except ImportError:
            log.warning("OpenLineage is configured but openlineage-python is not installed "
                        "(pip install 'pg2delta[lineage]'): no lineage events")
            return None
        lineage = cls(command, slot, OpenLineageClient())
        lineage._emit("START", [], [], {})
        return lineage

    def complete(self, outcome: Outcome, dsn: str | None, uris: dict[str, str]) -> None:
        """COMPLETE: the tables of ``outcome`` as inputs (on ``dsn``) and outputs (at ``uris``)."""
        from openlineage.client.event_v2 import InputDataset, OutputDataset
        from openlineage.client.facet_v2 import output_statistics_output_dataset

        inputs = [InputDataset(*postgres_dataset(dsn, t)) for t in sorted(outcome.tables)] if dsn else []
        outputs = []
        for table, rows in sorted(outcome.tables.items()):
            uri = uris.get(table)
            if uri is None:
                continue
            facets: dict[str, Any] = {}
            schema = _schema_facet(uri)
            if schema is not None:
                facets["schema"] = schema
            stats: dict[str, Any] = {}
            if self.command != "maintain":
                stats["outputStatistics"] = output_statistics_output_dataset.OutputStatisticsOutputDatasetFacet(rowCount=rows)
            outputs.append(OutputDataset(*delta_dataset(uri), facets=facets, outputFacets=stats))
        self._emit("COMPLETE", inputs, outputs, {"pg2delta": self._run_facet(outcome)})

    def finish(self, code: int, summary: dict[str, Any] | None, error: str | None, dsn: str | None,
               table_uri: Any) -> None:
        """COMPLETE for a command that ended with a report (exit 0, or an idle run's own code),
        FAIL with ``error`` (its one-line message) otherwise."""
        if summary is not None and (code == 0 or summary.get("idle")):
            outcome, uris = outcome_of(self.command, self.slot, summary, table_uri)
            self.complete(outcome, dsn if self.command != "maintain" else None, uris)
        else:
            self.fail(error or f"pg2delta {self.command} exited {code}")

    def fail(self, message: str) -> None:
        from openlineage.client.facet_v2 import error_message_run

        error = error_message_run.ErrorMessageRunFacet(message=message, programmingLanguage="python")
        self._emit("FAIL", [], [], {"errorMessage": error})

    def _run_facet(self, outcome: Outcome) -> Any:
        return _pg2delta_facet_class()(
            slot=outcome.slot, command=self.command, fromLsn=outcome.from_lsn, toLsn=outcome.to_lsn
        )

    def _emit(self, kind: str, inputs: list[Any], outputs: list[Any], run_facets: dict[str, Any]) -> None:
        from openlineage.client.event_v2 import Job, Run, RunEvent, RunState
        from openlineage.client.facet_v2 import job_type_job, parent_run, processing_engine_run

        try:
            facets: dict[str, Any] = {
                "processing_engine": processing_engine_run.ProcessingEngineRunFacet(
                    version=__version__, name="pg2delta", openlineageAdapterVersion=__version__
                ),
                **run_facets,
            }
            parent = _parent()
            if parent is not None:
                facets["parent"] = parent_run.ParentRunFacet(
                    run=parent_run.Run(runId=parent[2]), job=parent_run.Job(namespace=parent[0], name=parent[1])
                )
            job_facets: dict[str, Any] = {"jobType": job_type_job.JobTypeJobFacet(processingType="BATCH", integration="PG2DELTA",
                                                                  jobType="COMMAND")}
            event = RunEvent(
                eventType=getattr(RunState, kind),
                eventTime=_now(),
                run=Run(runId=self.run_id, facets=facets),
                job=Job(namespace=self.namespace, name=f"{self.slot}.{self.command}", facets=job_facets),
                producer=PRODUCER,
                inputs=inputs,
                outputs=outputs,
            )
            self.client.emit(event)
        except Exception as exc:  # lineage must never fail the command
            log.warning("openlineage: could not emit %s for %s: %s", kind, self.command, " ".join(str(exc).split())[:300])


def _pg2delta_facet_class() -> Any:
    """The ``pg2delta`` run facet, a custom facet as the client defines them (attrs, ``_get_schema``);
    built on first use, so that the module imports without openlineage-python."""
    global _FACET
    if _FACET is None:
        import attr
        from openlineage.client.facet_v2 import RunFacet

        @attr.define
        class Pg2DeltaRunFacet(RunFacet):
            slot: str
            command: str
            fromLsn: str | None = attr.field(default=None)  # OpenLineage spells its fields in camelCase
            toLsn: str | None = attr.field(default=None)

            @staticmethod
            def _get_schema() -> str:
                return _FACET_SCHEMA

        _FACET = Pg2DeltaRunFacet
    return _FACET


_FACET: Any = None


def _now() -> str:
    import datetime as dt

    return dt.datetime.now(dt.UTC).isoformat()


def _parent() -> tuple[str, str, str] | None:
    """``OPENLINEAGE_PARENT_ID`` (``namespace/job/run_id``) split, or None."""
    value = os.getenv("OPENLINEAGE_PARENT_ID", "")
    parts = value.split("/")
    if len(parts) < 3:
        return None
    return "/".join(parts[:-2]), parts[-2], parts[-1]


def _schema_facet(uri: str) -> Any:
    """The Delta table's columns as a schema facet (None if its log cannot be read here)."""
    from openlineage.client.facet_v2 import schema_dataset

    try:
        from deltalake import DeltaTable

        fields = DeltaTable(uri).schema().fields
    except Exception as exc:
        log.debug("openlineage: no schema of %s: %s", uri, exc)
        return None
    return schema_dataset.SchemaDatasetFacet(
        fields=[schema_dataset.SchemaDatasetFacetFields(name=f.name, type=_type_name(f.type)) for f in fields]
    )


def _type_name(t: Any) -> str:
    return str(getattr(t, "type", None) or getattr(t, "type_name", None) or t)


__all__ = ["WRITING_COMMANDS", "Lineage", "Outcome", "delta_dataset", "postgres_dataset"]
