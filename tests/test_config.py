from pathlib import Path

import pytest

from pg2delta.config import load
from pg2delta.delta_features import interval_hours, log_retention
from pg2delta.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_examples_load() -> None:
    for name in ("embedded.toml", "spark.toml"):
        cfg = load(REPO / "conf" / name, env={})
        assert cfg.source.slot == "pg2delta"
        assert cfg.lake_root
    assert load(REPO / "conf" / "spark.toml", env={}).engine.spark_conf == (("spark.sql.shuffle.partitions", "16"),)


def test_precedence_file_env_flag(tmp_path: Path) -> None:
    path = write(tmp_path, '[source]\ndsn = "dbname=a"\nslot = "file"\n[lake]\nroot = "/l"\n[window]\nmax_changes = 5\n')
    cfg = load(path, env={"PG2DELTA_SLOT": "env", "PG2DELTA_MAX_CHANGES": "7"})
    assert (cfg.source.slot, cfg.window.max_changes) == ("env", 7)
    cfg = load(path, env={"PG2DELTA_SLOT": "env"}, slot="flag", max_changes=None)
    assert (cfg.source.slot, cfg.window.max_changes) == ("flag", 5)


def test_table_keys(tmp_path: Path) -> None:
    path = write(tmp_path, '[source]\ndsn = "x"\n[lake]\nroot = "/l"\n[tables."public.t"]\nkey = ["a", "b"]\n')
    cfg = load(path, env={})
    assert cfg.table("public", "t").key == ("a", "b")
    assert cfg.table("public", "other").key == ()
    spark = write(tmp_path, '[source]\ndsn = "x"\n[lake]\nroot = "/l"\n[engine]\nkind = "spark"\n[tables."public.t"]\ncluster_by = ["a", "b"]\n')
    assert load(spark, env={}).delta_features("public", "t").cluster_by == ("a", "b")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[source\n", "not valid TOML"),
        ('[source]\nslott = "x"\n', "unknown setting source.slott"),
        ("[bogus]\n", "unknown section"),
        ('[source]\ndsn = "x"\n[lake]\nroot = "/l"\n[window]\nmax_changes = "many"\n', "whole number"),
        ('[source]\ndsn = "x"\n[lake]\nroot = "/l"\n[engine]\nkind = "flink"\n', "unknown engine"),
        ('[source]\ndsn = "x"\n', "no lake root"),
        ('[lake]\nroot = "/l"\n', "no source DSN"),
        ('[source]\ndsn = "x"\ncreate_slot = "yes"\n[lake]\nroot = "/l"\n', "true or false"),
        ('[source]\ndsn = "x"\n[lake]\nroot = "/l"\n[tables."t"]\nkey = ["a"]\n', "schema.table"),
        ('[source]\ndsn = "x"\n[lake]\nroot = "/l"\ndeletion_vectors = "no"\n', "true or false"),
        ('[source]\ndsn = "x"\n[lake]\nroot = "/l"\n[engine]\ndeletion_vectors = false\n', "a \\[lake\\] setting"),
        ('[source]\ndsn = "x"\n[lake]\nroot = "/l"\n[tables."s.t"]\ncluster_by = ["a", "b", "c", "d", "e"]\n', "at most 4"),
        ('[source]\ndsn = "x"\n[lake]\nroot = "/l"\n[tables."s.t"]\ncluster_by = ["a", "a"]\n', "at most 4 distinct"),
        ('[source]\ndsn = "x"\n[lake]\nroot = "/l"\n[tables."s.t"]\ncluster_by = ["a"]\n', "clustering, which the embedded engine"),
    ],
)
def test_broken_configs(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(write(tmp_path, text), env={})


def test_missing_file_and_bad_env(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load(tmp_path / "nope.toml", env={})
    with pytest.raises(ConfigError, match="PG2DELTA_MAX_BYTES"):
        load(None, env={"PG2DELTA_MAX_BYTES": "lots"}, dsn="x", lake="/l")


def test_table_schema_change_settings(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[source]\ndsn = "x"\n[lake]\nroot = "/l"\n[tables."public.m"]\npartitions = "root"\n'
        '[tables."public.t"]\ndropped_columns = "drop"\nnarrowing = "keep"\non_unfollowable = "resync"\n',
    )
    cfg = load(path, env={})
    assert cfg.table("public", "m").partitions == "root"
    assert (cfg.table("public", "t").dropped_columns, cfg.table("public", "t").narrowing) == ("drop", "keep")
    assert cfg.table("public", "t").on_unfollowable == "resync"
    other = cfg.table("public", "other")
    assert (other.partitions, other.dropped_columns, other.narrowing, other.on_unfollowable) == ("leaf", "keep", "refuse", "stop")


@pytest.mark.parametrize(
    ("setting", "fragment"),
    [
        ('partitions = "roots"', "partitions must be one of leaf, root"),
        ('dropped_columns = "forget"', "dropped_columns must be one of keep, drop"),
        ('narrowing = "yes"', "narrowing must be one of refuse, keep"),
        ('on_unfollowable = "fix"', "on_unfollowable must be one of stop, resync"),
        ('target = "s.x"', "unknown setting(s) ['target']"),
    ],
)
def test_table_schema_change_settings_rejected(tmp_path: Path, setting: str, fragment: str) -> None:
    path = write(tmp_path, f'[source]\ndsn = "x"\n[lake]\nroot = "/l"\n[tables."public.t"]\n{setting}\n')
    with pytest.raises(ConfigError) as err:
        load(path, env={})
    assert fragment in str(err.value)


def test_catalog_names(tmp_path: Path) -> None:
    base = '[source]\ndsn = "x"\n[lake]\nroot = "/l"\ndatabase = "bronze"\n'
    spark = '[engine]\nkind = "spark"\n'
    cfg = load(write(tmp_path, base + spark))
    assert cfg.catalog_name("public", "orders") == "bronze.public_orders"
    cfg = load(write(tmp_path, base.replace('"bronze"', '"main.bronze"') + 'table_name = "{table}"\n' + spark))
    assert cfg.catalog_name("shop", "orders") == "main.bronze.orders"
    assert load(write(tmp_path, '[source]\ndsn = "x"\n[lake]\nroot = "/l"\n')).catalog_name("public", "orders") is None
    # The embedded engine keeps no catalog: refused, not ignored.
    with pytest.raises(ConfigError, match="embedded engine"):
        load(write(tmp_path, base))
    for bad, fragment in (('table_name = "{schema}"', "must name {table}"), ('table_name = "{x}_{table}"', "only {schema}"),
                          ('table_name = "a-{table}"', "letters, digits"), ):
        with pytest.raises(ConfigError, match=fragment):
            load(write(tmp_path, base + bad + "\n" + spark))
    with pytest.raises(ConfigError, match="give a database name"):
        load(write(tmp_path, base.replace('"bronze"', '"bro nze"') + spark))


def test_deletion_vectors_setting(tmp_path: Path) -> None:
    """[lake] deletion_vectors: on unless the file says otherwise; the engine gets it."""
    on = load(write(tmp_path, '[source]\ndsn = "x"\n[lake]\nroot = "/l"\n'), env={})
    assert on.deletion_vectors and on.engine.deletion_vectors
    off = load(write(tmp_path, '[source]\ndsn = "x"\n[lake]\nroot = "/l"\ndeletion_vectors = false\n'), env={})
    assert not off.deletion_vectors and not off.engine.deletion_vectors


def test_interval_hours() -> None:
    assert interval_hours("interval 7 days") == 168
    assert interval_hours("INTERVAL 36 HOURS") == 36
    assert interval_hours("interval 1 day 12 hours") == 36
    assert interval_hours("interval 2 weeks") == 336
    assert interval_hours("interval 30 minutes") == 0.5
    for unreadable in (None, "interval 1 month", "interval -1 day", "7 days", "interval 1 dayz", "interval"):
        assert interval_hours(unreadable) is None, unreadable


def test_log_retention() -> None:
    # Not set: as long as the files' retention, at least a day; nothing where that is Delta's 30 days.
    assert log_retention(None, 168) == "interval 7 days"
    assert log_retention(None, 1) == "interval 1 day"
    assert log_retention(None, 36) == "interval 36 hours"
    assert log_retention(None, 720) is None
    # Set shorter than the files' retention: raised; as long or longer, or unreadable: left.
    assert log_retention("interval 1 day", 48) == "interval 2 days"
    assert log_retention("interval 2 days", 48) is None
    assert log_retention("interval 30 days", 168) is None
    assert log_retention("interval 1 month", 168) is None
