#!/usr/bin/env bash
# The small-scale reproductions of the README's results table, one after another, each a sweep or run plus its
# figures (experiments/figures/*.png) and final numbers (experiments/results/*.jsonl). On a 2-core CPU:
# about 50 minutes for all but the DSA run, which takes an hour or more. Rerunning skips what has finished.
#   bash scripts/with_env.sh bash experiments/reproduce_small.sh [runs dir, default runs/repro]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
R="${1:-runs/repro}"
F=experiments/figures
S=experiments/results
mkdir -p "$F" "$S"
stamp() { echo "[reproduce] $(date -u +%H:%M:%S) $*"; }

# Muon (with the Muon split) vs AdamW at matched steps and LR, and the MTP layer on vs off: glm5_tiny's 600 steps.
stamp optimizer_mtp
python launch/sweep.py --config=configs/glm5_tiny.py --workdir="$R/optimizer_mtp" \
    --sweep="optimizer.name=muon,adamw;model.num_nextn_predict_layers=1,0"
cp "$R/optimizer_mtp/results.jsonl" "$S/optimizer_mtp.jsonl"
python launch/plot.py --sweep="$R/optimizer_mtp" --metric=eval_loss --against=optimizer.name \
    --title="held-out loss after 600 steps" --out="$F/optimizer_mtp_eval_loss.png"
python launch/plot.py --sweep="$R/optimizer_mtp" --metrics=lm_loss --out="$F/optimizer_mtp_curves.png"

# IcePop vs truncated IS vs no correction, with rollouts sampled in bf16 and the policy trained in fp32.
stamp icepop
python launch/sweep.py --config=configs/grpo_tiny.py --workdir="$R/icepop" \
    --sweep="rl.is_correction=icepop,truncated,none" --config.rl.rollout_dtype=bfloat16
cp "$R/icepop/results.jsonl" "$S/icepop.jsonl"
python launch/plot.py --sweep="$R/icepop" --metrics=reward_mean,mismatch_kl,icepop_drop_frac \
    --title="GRPO with bf16 rollouts, fp32 training" --out="$F/icepop.png"
python experiments/summarize.py --sweep="$R/icepop" --metrics=reward_mean,mismatch_kl,icepop_drop_frac,eval_accuracy \
    > "$S/icepop_summary.jsonl"

# The shipped post-training configs as they are: GRPO's reward and distillation's KL to its teachers.
stamp grpo_tiny
python launch/train.py --config=configs/grpo_tiny.py --workdir="$R/grpo_tiny" | tail -1 > "$S/grpo_tiny.json"
stamp distill_tiny
python launch/train.py --config=configs/distill_tiny.py --workdir="$R/distill_tiny" | tail -1 > "$S/distill_tiny.json"
python launch/plot.py --workdirs="$R/grpo_tiny" --metrics=reward_mean,eval_accuracy --title="configs/grpo_tiny.py" \
    --out="$F/grpo_tiny.png"
python launch/plot.py --workdirs="$R/distill_tiny" --metrics=teacher_kl,teacher_kl/addition,teacher_kl/sort \
    --title="configs/distill_tiny.py" --out="$F/distill_tiny.png"
python experiments/summarize.py --workdirs="$R/grpo_tiny" --metrics=reward_mean,eval_accuracy,mismatch_kl \
    > "$S/grpo_tiny_summary.jsonl"
python experiments/summarize.py --workdirs="$R/distill_tiny" \
    --metrics=teacher_kl,teacher_kl/addition,teacher_kl/sort,eval_accuracy > "$S/distill_tiny_summary.jsonl"

# GLM-130B's blank infilling against a same-size causal model, and DeepNorm / EGS at a learning rate that spikes.
stamp glm_infilling
python experiments/glm_infilling.py --workdir="$R/glm_infilling" --results="$S/glm_infilling.jsonl"
stamp glm_stability
python experiments/glm_stability.py --workdir="$R/glm_stability" --lr=1e-2 --results="$S/glm_stability.jsonl" \
    --figure="$F/glm_stability.png"

# DSA keeps quality: dense vs warm-up + sparse at 2,048-token rows, top-k 64 / 128 / 256.
stamp dsa_quality
python experiments/dsa_quality.py --workdir="$R/dsa_quality" --results="$S/dsa_quality.json" \
    --figure="$F/dsa_quality.png" --branch_figure="$F/dsa_quality_branches.png"
stamp done
