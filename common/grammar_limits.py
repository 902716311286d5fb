"""The resource limits of the grammar engine (llguidance), one set for the whole group.

The gateway validates every grammar under these limits before it submits a request, and the
worker builds its matchers under the same ones, so a grammar that passed the gateway cannot
exceed them mid-step (docs/design/requests.md "Structured outputs"). llguidance is imported on use.
"""

from __future__ import annotations


def parser_limits():
    import llguidance

    # Lexer fuel and Earley items per step bound one mask's CPU time (~14k fuel and ~20k items
    # per ms); lexer states and grammar size bound memory.
    return llguidance.LLParserLimits(step_lexer_fuel=200_000, step_max_items=50_000,
                                     max_lexer_states=100_000, max_grammar_size=200_000,
                                     verbose_errors=False)
