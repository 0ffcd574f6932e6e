"""How much work the grammar library may spend on one request's grammar (`TPLA_GRAMMAR_*`).

A grammar that needs more stops, and the request it belongs to ends with that error (no
other request, no worker, is affected): the limits bound what one structured-output request
can cost a decode step. Torch-free, so configs can carry them.
"""

from __future__ import annotations

from dataclasses import dataclass

import llguidance

from common.runtime.settings import Settings


@dataclass(frozen=True)
class GrammarLimits:
    """llguidance's parser limits. The defaults are llguidance's own; its documentation gives
    their cost (items ~20k/ms, lexer fuel ~14k/ms), so a token mask stays within a few ms."""

    max_items_in_row: int = 2000  # Earley items in one parser row (the grammar's ambiguity)
    step_max_items: int = 50_000  # Earley items one token mask may create
    step_lexer_fuel: int = 200_000  # lexer work one token mask may spend
    initial_lexer_fuel: int = 1_000_000  # lexer work to build the grammar's regexes

    @classmethod
    def from_settings(cls, s: Settings) -> GrammarLimits:
        return cls(
            s.grammar_max_items_in_row,
            s.grammar_step_max_items,
            s.grammar_step_lexer_fuel,
            s.grammar_initial_lexer_fuel,
        )

    def to_llguidance(self) -> llguidance.LLParserLimits:
        # Errors stay short: a verbose one carries the parser's state and the grammar, and
        # goes back to the client.
        return llguidance.LLParserLimits(
            max_items_in_row=self.max_items_in_row,
            step_max_items=self.step_max_items,
            step_lexer_fuel=self.step_lexer_fuel,
            initial_lexer_fuel=self.initial_lexer_fuel,
            verbose_errors=False,
        )


# What a service without TPLA_GRAMMAR_* settings applies (llguidance's own defaults).
DEFAULT_LIMITS = GrammarLimits()
