import pytest
from hypothesis import given
from hypothesis import strategies as st

from pg2delta.errors import ConfigError
from pg2delta.lsn import format_lsn, parse_lsn


def test_parse_known_values() -> None:
    assert parse_lsn("0/0") == 0
    assert parse_lsn("16/B374D848") == 0x16B374D848
    assert parse_lsn("ffffffff/ffffffff") == 2**64 - 1


@pytest.mark.parametrize("bad", ["", "0", "0/", "/1", "1/2/3", "g/0", "123456789/0", "0x10/0"])
def test_parse_rejects(bad: str) -> None:
    with pytest.raises(ConfigError):
        parse_lsn(bad)


@given(st.integers(min_value=0, max_value=2**64 - 1))
def test_round_trip(value: int) -> None:
    assert parse_lsn(format_lsn(value)) == value
