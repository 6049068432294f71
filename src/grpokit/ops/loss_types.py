"""The names of the GRPO loss variants: the one declaration of `LossType`.

It lives in its own file with no torch import so that both sides can share it without breaking a
rule: `ops.policy_loss` (the variants' math, its `LOSS_TYPES` table checked against this list) must
not import the config, and `config.schema` (the `loss_type` option) must not import torch. ops and
config are both the bottom layer, so the config reading this file is no arrow back up.
"""

from __future__ import annotations

from typing import Literal

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo", "opd", "gkd"]
