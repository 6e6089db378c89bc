"""The Locust entry point of a load actor: users and shape come from `PDCHAOS_LOAD_CONFIG`.

Started by the driver as a subprocess (Locust must not be imported inside a Ray worker;
see chaos/cluster.py), from the repository root:

    PDCHAOS_LOAD_CONFIG='<LoadConfig JSON>' python -m locust --headless \\
        -f loadprofiles/locustfile.py --json --only-summary --skip-log

The shape class below drives users and duration (no --users/--run-time); --host is optional
(`target_url` is the default). Records go to `records_path` as JSON lines as they complete;
stdout is Locust's JSON stats list. Exit status 0 means the run went through, however many
requests failed (those are data, in the records); 1 means our user code raised (a bug) or the
locustfile could not load.
"""

from __future__ import annotations

import os
import sys
from typing import Any

try:
    import loadprofiles  # noqa: F401  (installed, or run from the repository root)
except ImportError:  # started from elsewhere without an install: the repository is one level up
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from locust import events

from loadprofiles.config import LoadConfig
from loadprofiles.shapes import shape_class
from loadprofiles.users import LoadContext, user_classes

CONFIG = LoadConfig.from_env()
CONTEXT = LoadContext.create(CONFIG)

# Locust looks for user classes and one shape class among this module's globals.
globals().update({cls.__name__: cls for cls in user_classes(CONTEXT)})
LoadShape = shape_class(CONFIG.shape, CONFIG.clock_path)


@events.quitting.add_listener  # type: ignore[untyped-decorator]  # locust's add_listener is not annotated
def _exit_status(environment: Any, **_kwargs: Any) -> None:
    """Request failures are findings, not a broken run: only exceptions in our code fail it."""
    runner = environment.runner
    environment.process_exit_code = 1 if runner is not None and runner.exceptions else 0
