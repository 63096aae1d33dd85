"""docs/api.md names every public name and every configuration key."""

import dataclasses
import pathlib
import re

import smp_tf
from smp_tf.config import Config

API = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()


def test_every_public_name_is_in_the_api_page():
    # As `name`, `smp.name`, or followed by its signature's parenthesis.
    missing = [n for n in smp_tf.__all__ if not re.search(r"`(smp\.)?%s[`(]" % re.escape(n), API)]
    assert not missing, f"docs/api.md does not name: {missing}"


def test_every_config_key_is_in_the_api_page():
    missing = [f.name for f in dataclasses.fields(Config) if f"`{f.name}`" not in API]
    assert not missing, f"docs/api.md does not describe the config keys: {missing}"
