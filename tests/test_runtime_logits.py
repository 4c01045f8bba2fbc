"""The post-head steps read from a target's config (runtime/logits.py)."""

from __future__ import annotations

import torch
import transformers
from dflash.runtime.logits import apply_post_head, post_head_steps


def test_each_family_names_its_own_steps_and_a_multimodal_config_its_text_models():
    assert post_head_steps(transformers.Qwen3Config()) == {"scale": None, "softcap": None}
    assert post_head_steps(transformers.CohereConfig(logit_scale=0.25)) == {"scale": 0.25, "softcap": None}
    assert post_head_steps(transformers.GraniteConfig(logits_scaling=4.0)) == {"scale": 0.25, "softcap": None}
    # Gemma 3's soft cap lives in the text config of the multimodal one
    gemma = transformers.Gemma3Config(text_config={"final_logit_softcapping": 30.0})
    assert post_head_steps(gemma) == {"scale": None, "softcap": 30.0}


def test_the_steps_are_a_scale_then_a_soft_cap():
    z = torch.linspace(-40, 40, 9)
    torch.testing.assert_close(apply_post_head(z, scale=0.5, softcap=10.0), torch.tanh(z * 0.5 / 10.0) * 10.0)
    assert apply_post_head(z) is z
