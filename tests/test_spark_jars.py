"""Where a classic session pyspark starts itself finds Delta's jars named: the config, pyspark's
``PYSPARK_SUBMIT_ARGS`` (``--jars``, ``--packages``, or a ``--properties-file``, which replaces
``spark-defaults.conf`` as in spark-submit), else ``SPARK_CONF_DIR``'s ``spark-defaults.conf``.
When none names them, pg2delta lets delta-spark name them (an Ivy resolution at start)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pg2delta.lake.engine_session import _delta_jars_named


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("PYSPARK_GATEWAY_PORT", "PYSPARK_SUBMIT_ARGS", "SPARK_CONF_DIR", "SPARK_HOME"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_where_the_jars_are_named(clean: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with_jars, without = tmp_path / "with.conf", tmp_path / "without.conf"
    with_jars.write_text("# Delta\nspark.jars /opt/delta-spark.jar\nspark.master local[2]\n")
    without.write_text("spark.master local[2]\n")
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    (conf_dir / "spark-defaults.conf").write_text(with_jars.read_text())

    assert not _delta_jars_named({})
    assert _delta_jars_named({"spark.jars.packages": "io.delta:delta-spark_2.12:3.3.2"})
    clean.setenv("SPARK_CONF_DIR", str(conf_dir))
    assert _delta_jars_named({})
    # a properties file replaces spark-defaults.conf: it decides alone
    clean.setenv("PYSPARK_SUBMIT_ARGS", f"--properties-file {without} pyspark-shell")
    assert not _delta_jars_named({})
    clean.setenv("PYSPARK_SUBMIT_ARGS", f"--properties-file {with_jars} pyspark-shell")
    clean.setenv("SPARK_CONF_DIR", str(tmp_path / "empty"))
    assert _delta_jars_named({})
    clean.setenv("PYSPARK_SUBMIT_ARGS", "--jars /opt/delta-spark.jar,/opt/delta-storage.jar pyspark-shell")
    assert _delta_jars_named({})
    clean.setenv("PYSPARK_SUBMIT_ARGS", f"--properties-file {tmp_path / 'missing.conf'} pyspark-shell")
    assert not _delta_jars_named({})
    clean.setenv("PYSPARK_GATEWAY_PORT", "12345")  # under spark-submit: its JVM has what it was given
    assert _delta_jars_named({})
