"""Baton's client SDK, re-exported from the baton-client distribution (``baton_client``), which
owns it and the public API's generated stubs; ``from baton.client import Client`` keeps working."""

from baton_client import *  # noqa: F403
from baton_client import __all__  # noqa: F401
