"""The API pages name every public name and every configuration key."""

import dataclasses
import pathlib
import re

import smp_tf
from smp_tf.config import Config

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
# The Python API is split over api.md, config.md and api_inspection.md.
API = "\n".join((DOCS / name).read_text() for name in ("api.md", "config.md", "api_inspection.md"))
CONFIG = (DOCS / "config.md").read_text()


def test_every_public_name_is_in_the_api_pages():
    # As `name`, `smp.name`, or followed by its signature's parenthesis.
    missing = [n for n in smp_tf.__all__ if not re.search(r"`(smp\.)?%s[`(]" % re.escape(n), API)]
    assert not missing, f"docs/api.md, docs/config.md and docs/api_inspection.md do not name: {missing}"


def test_every_config_key_is_in_the_config_page():
    missing = [f.name for f in dataclasses.fields(Config) if f"`{f.name}`" not in CONFIG]
    assert not missing, f"docs/config.md does not describe the config keys: {missing}"
