"""Hooks for the schemathesis CLI run by hand against a live group (docs/design/security.md "Security"):

    SCHEMATHESIS_HOOKS=tests.helpers.schemathesis_hooks PYTHONPATH=. \
        .venv/bin/schemathesis run http://127.0.0.1:PORT/openapi.json --checks all \
        --max-response-time 60

against a group started with short replies, e.g. `switchyard serve --model tiny --ctx 1024
--default-max-tokens 16` (`--max-response-time`: a request without a token limit generates up
to --default-max-tokens, which a model on 2 CPU cores writes in more than schemathesis' default
10 s). With one seed that ran 3,905 cases in 104 s with no server error; its two
findings were prompts over the 1,024-token context, the documented 400 that schemathesis'
positive-data check does not accept.

Each schema-valid generated request is made to follow what the spec can only state in words
(tests/helpers/openapi_rules.py), as the CI test does; schema-violating ones are sent as
generated.
"""

from __future__ import annotations

import schemathesis

from tests.helpers.openapi_rules import follow_unstateable_rules


@schemathesis.hook
def before_call(ctx, case, **kwargs):
    meta = getattr(case, "_meta", None)
    if meta is None or not meta.generation.mode.is_negative:
        follow_unstateable_rules(case.body)
