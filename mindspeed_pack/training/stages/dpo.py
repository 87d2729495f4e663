"""Direct preference optimisation on packed pairs (``posttrain.py --stage dpo``).

Per pair (:mod:`.pairs`: the pair layout, the margin losses, the normalisation by the global
batch's pairs), from the per-sequence log-prob sums of the policy and of the reference::

    z = (logp_c - logp_r) - (ref_c - ref_r)        (ipo: per-token means, as TRL's IPO)
    loss = margin loss of z (--dpo-loss-type, --dpo-label-smoothing) + --pref-ftx SFT term

Logged as TRL logs them, whatever the loss: ``rewards/*`` = beta x (policy - reference)
log-prob *sums*, ``logps/*`` the policy's sums.

The reference: a frozen copy run in the same job (``--ref-load DIR``: a Megatron checkpoint or a
Hugging Face directory, loaded and checked as ``--load``; default the starting policy), through
the same pipeline, or log-probs precomputed once (``--ref-logps``, :mod:`.reference`) and looked
up by (pack, pair). With LoRA the default reference is the frozen base itself: the policy's own
module run with its adapters switched off (no second model).
"""
from __future__ import annotations

import contextlib
import logging

import torch
from megatron.core import parallel_state as ps

from mindspeed_pack.datasets.packed_dataset import DataError
from mindspeed_pack.model import lora
from mindspeed_pack.runtime.platform import cuda_usable
from mindspeed_pack.training.stages import reference
from mindspeed_pack.training.stages.pairs import PairStage, PairTerms, check_label_smoothing, margin_losses
from mindspeed_pack.training.stages.sequences import pair_segments

log = logging.getLogger(__name__)


def preference_losses(chosen, rejected, ref_chosen, ref_rejected, beta: float, loss_type: str,
                      label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-pair loss of DPO (sigmoid), IPO or the hinge loss from the four log-probs."""
    check_label_smoothing(label_smoothing, loss_type)
    return margin_losses((chosen - rejected) - (ref_chosen - ref_rejected), beta, loss_type, label_smoothing)


def _unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


class DPOStage(PairStage):
    name = "dpo"

    def __init__(self, args):
        super().__init__(args)
        if args.ref_load and args.ref_logps:
            raise DataError("--ref-load and --ref-logps both given: the reference is either a model run in this job "
                            "or log-probs precomputed by --stage dpo_reference, not both")
        check_label_smoothing(args.dpo_label_smoothing, args.dpo_loss_type)
        self.reference = None  # frozen model chunks (in-job reference)
        self.base_as_reference = False  # LoRA: the reference is the policy's chunks with the adapters off
        self.tables = None  # {prefix: ReferenceTable} (precomputed reference)

    # ---------------------------------------------------------------- setup
    def setup(self, trainer) -> None:
        super().setup(trainer)
        args = self.args
        source = reference.reference_source(args)
        if source == reference.TABLE:
            self.tables = {docs.prefix: reference.ReferenceTable.load_for(docs) for docs in trainer.source.docs}
            log.info("dpo: precomputed reference log-probs (%s)", ", ".join(t.path for t in self.tables.values()))
            return
        if source == reference.ADAPTERS_OFF:
            self.reference, self.base_as_reference = trainer.model, True
            log.info("dpo: reference model = the frozen base --load %s: the policy's own module with its LoRA adapters "
                     "switched off (no second model in memory)", args.load)
            return
        self.reference = [self._reference_model(trainer)]

    def _reference_model(self, trainer):
        from megatron.core.transformer.module import Float16Module
        from megatron.core.utils import get_model_config

        from mindspeed_pack.checkpoint import save_load
        from mindspeed_pack.model.gpt import build_gpt_model

        args = self.args
        model = build_gpt_model(lora.without_lora(args), pre_process=ps.is_pipeline_first_stage(),
                                post_process=ps.is_pipeline_last_stage())
        if args.ref_load:
            save_load.load_model_weights(args, args.ref_load, model, "--ref-load")
            log.info("dpo: reference model loaded from %s (frozen)", args.ref_load)
        elif trainer.iteration > 0:
            raise DataError(f"--stage dpo resumes at iteration {trainer.iteration}: the reference is the *starting* "
                            "policy, which the checkpoint no longer holds; pass --ref-load (the model the run "
                            "started from: its Megatron checkpoint or Hugging Face directory) or --ref-logps")
        else:
            model.load_state_dict(_unwrap(trainer.model[0]).state_dict(), strict=True)
            log.info("dpo: reference model = a frozen copy of the starting policy")
        if cuda_usable():
            model.cuda(torch.cuda.current_device())
        if args.bf16 or args.fp16:
            model = Float16Module(get_model_config(model), model)
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        return model

    # ---------------------------------------------------------------- per step
    def prepare(self, trainer, batches, micro_batches, split, tokens_per_micro_batch):
        if self.reference is not None:
            with lora.base_model_only(self.reference) if self.base_as_reference else contextlib.nullcontext():
                scores = reference.score_sequences(self.reference, batches, tokens_per_micro_batch)
            for batch, seq in zip(batches, scores):
                if seq is not None:
                    chosen, rejected = pair_segments(batch)
                    batch.ref_logps = torch.stack([seq[chosen], seq[rejected]], dim=1)
            return batches
        prefix = trainer.source.splits[split].docs.prefix
        for batch, mb in zip(batches, micro_batches):
            batch.ref_logps = self.tables[prefix].lookup(mb).to(batch.loss_mask.device)
        return batches

    def pair_terms(self, batch, logps, counts, chosen, rejected) -> PairTerms:
        args = self.args
        pc, pr = logps[chosen], logps[rejected]
        ref = batch.ref_logps.to(pc.dtype)
        rc, rr = ref[:, 0], ref[:, 1]
        # IPO compares per-token means (in its loss only: the logged rewards stay sums)
        ipo = args.dpo_loss_type == "ipo"
        nc, nr = (counts[chosen].clamp(min=1), counts[rejected].clamp(min=1)) if ipo else (1.0, 1.0)
        losses = preference_losses(pc / nc, pr / nr, rc / nc, rr / nr, args.dpo_beta, args.dpo_loss_type,
                                   args.dpo_label_smoothing)
        # TRL's rewards whatever the loss: beta x (policy - reference) log-prob sums
        return PairTerms(losses + self.sft_term(logps, counts, chosen), (args.dpo_beta * (pc - rc)).detach(),
                         (args.dpo_beta * (pr - rr)).detach(), pc.detach(), pr.detach())
