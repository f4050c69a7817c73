#!/usr/bin/env bash
# Compiles MaxText's train step ahead of time for a TPU topology, on a CPU-only
# host (libtpu's compile-only topology), and saves the optimized HLO.
#
# Usage: experiments/maxtext/compile.sh CASE [key=value ...]
#   CASE is one of:
#     tiny       deepseek3-tiny on v5p-8, the quick sanity check (about a minute).
#     671b       DeepSeek-V3 671B, the tpu-recipes v5p-1024 recipe (see README.md); it runs out
#                of HBM by 1.5% under 0.2.5, while per_device_batch_size=5 compiles.
#     v32        DeepSeek-V3.2 671B (DSA indexer, dense mask) on v5p-1024, seq 4096,
#                otherwise the 671b recipe's flags (plus attention=flash use_tokamax_splash=True).
#   Extra key=value arguments override MaxText settings (they come last, so
#   they win), e.g. `compile.sh 671b base_num_decoder_layers=8`.
# Env:
#   MAXTEXT_VENV  the venv made by setup_venv.sh (default experiments/maxtext/.venv)
#   NAME          output name (default: CASE); outputs go to OUT_DIR/NAME.*
#   OUT_DIR       default experiments/maxtext/out
#   TIMEOUT       wall-clock limit, default 60m
#   XLA_DUMP=1    also dump the train step's HLO with --xla_dump_to (OUT_DIR/NAME.xla_dump);
#                 its *after_optimizations.txt survives a compile that runs out of HBM.
#   NO_RECIPE_XLA_FLAGS=1  do not set the recipe's LIBTPU_INIT_ARGS.
#   EXTRA_LIBTPU_INIT_ARGS  compiler flags put after the recipe's (so they win), e.g.
#                 EXTRA_LIBTPU_INIT_ARGS="--xla_latency_hiding_scheduler_rerun=5"
#
# Outputs: OUT_DIR/NAME.hlo.txt (compiled.as_text()), OUT_DIR/NAME.json (memory and
# cost analysis a chip, compile time), OUT_DIR/NAME.log (stdout+stderr, with
# /usr/bin/time -v's peak RSS at the end).
set -euo pipefail

# Everything is in main so that bash reads the whole script before it runs.
main() {
  HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
  VENV="${MAXTEXT_VENV:-${HERE}/.venv}"
  PY="${VENV}/bin/python"
  CASE="${1:?usage: compile.sh tiny|671b|v32 [key=value ...]}"
  shift
  NAME="${NAME:-${CASE}}"
  OUT_DIR="${OUT_DIR:-${HERE}/out}"
  TIMEOUT="${TIMEOUT:-60m}"
  mkdir -p "${OUT_DIR}"

  if [[ ! -x "${PY}" ]]; then
    echo "No MaxText venv at ${VENV}; run experiments/maxtext/setup_venv.sh first." >&2
    exit 1
  fi
  BASE_YML="$("${PY}" -c 'import maxtext, os; print(os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml"))')"

  # Settings every case shares: compile only, no data, no checkpoints, no GCS.
  COMMON=(
    skip_jax_distributed_system=True
    dataset_type=synthetic
    enable_checkpointing=False
    base_output_directory="${OUT_DIR}/maxtext_runs"
    run_name="${NAME}"
    compile_topology_num_slices=1
  )

  # The tuning parameters of deepseek3_671b_v5p_1024 in MaxText's
  # benchmarks/maxtext_v5p_model_configs.py at commit 3eb77db (the commit the
  # tpu-recipes README pins). tile_batch_seq/tile_embed_dim/tile_mlp_dim (512,
  # 1024, 1024) were renamed wi_tile_*/wo_tile_* since, with the same defaults,
  # so they are left out. The profiler settings are left out (no run).
  # load_balance_loss_weight=0.01 was base.yml's default at 3eb77db (0.2.5's is 0.0).
  RECIPE_671B=(
    ici_fsdp_parallelism=-1
    ici_tensor_parallelism=1
    per_device_batch_size=6
    max_target_length=8192
    dtype=bfloat16
    weight_dtype=float32
    megablox=True
    sparse_matmul=True
    scan_layers=True
    use_custom_sort_vjp=True
    sa_block_q=2048
    sa_block_kv=2048
    sa_block_kv_compute=2048
    sa_block_q_dkv=2048
    sa_block_kv_dkv=2048
    sa_block_kv_dkv_compute=2048
    sa_block_q_dq=2048
    sa_block_kv_dq=2048
    sa_use_fused_bwd_kernel=False
    remat_policy=custom
    decoder_layer_input=offload
    out_proj=offload
    load_balance_loss_weight=0.01
  )

  # The recipe's xla_flags (benchmarks/xla_flags_library.py at 3eb77db), which the
  # benchmark runner exports as LIBTPU_INIT_ARGS: sparse-core offload of
  # RS/AG/AR, host-offload scheduler flags, all-reduce/reduce-scatter layout, data
  # parallel overlap, the MoE scoped VMEM limit, no megacore fusion of
  # all-gathers, async collective-permute. Left out: the recipe's
  # --2a886c8_chip_config_name=megachip_tccontrol (part of the sparse-core offload
  # base flags), which libtpu 0.0.52 rejects ("Unknown command line flag").
  RECIPE_LIBTPU_INIT_ARGS="\
 --xla_tpu_enable_async_collective_fusion_fuse_all_gather=false\
 --xla_tpu_enable_async_collective_fusion_fuse_all_reduce=false\
 --xla_tpu_enable_async_collective_fusion_fuse_reduce_scatter=false\
 --xla_tpu_enable_sparse_core_collective_offload_all_gather=true\
 --xla_tpu_enable_sparse_core_collective_offload_reduce_scatter=true\
 --xla_tpu_enable_sparse_core_collective_offload_all_reduce=true\
 --xla_tpu_enable_all_gather_offload_tracing=true\
 --xla_tpu_enable_reduce_scatter_offload_tracing=true\
 --xla_tpu_enable_all_reduce_offload_tracing=true\
 --xla_tpu_use_tc_device_shape_on_sc=true\
 --xla_sc_enable_instruction_fusion=false\
 --xla_sc_disjoint_spmem=false\
 --xla_sc_disable_megacore_partitioning=true\
 --xla_tpu_enable_all_experimental_scheduler_features=true\
 --xla_tpu_enable_scheduler_memory_pressure_tracking=true\
 --xla_tpu_host_transfer_overlap_limit=24\
 --xla_tpu_aggressive_opt_barrier_removal=ENABLED\
 --xla_lhs_prioritize_async_depth_over_stall=ENABLED\
 --xla_tpu_enable_ag_backward_pipelining=true\
 --xla_should_allow_loop_variant_parameter_in_chain=ENABLED\
 --xla_should_add_loop_invariant_op_in_chain=ENABLED\
 --xla_max_concurrent_host_send_recv=100\
 --xla_tpu_scheduler_percent_shared_memory_limit=100\
 --xla_latency_hiding_scheduler_rerun=2\
 --xla_tpu_use_minor_sharding_for_major_trivial_input=true\
 --xla_tpu_relayout_group_size_threshold_for_reduce_scatter=1\
 --xla_tpu_assign_all_reduce_scatter_layout=true\
 --xla_tpu_enable_data_parallel_all_reduce_opt=true\
 --xla_tpu_data_parallel_opt_different_sized_ops=true\
 --xla_tpu_scoped_vmem_limit_kib=81920\
 --xla_tpu_megacore_fusion_allow_ags=false\
 --xla_enable_async_collective_permute=true"

  case "${CASE}" in
    tiny)
      ARGS=(model_name=deepseek3-tiny compile_topology=v5p-8 per_device_batch_size=1 max_target_length=512)
      LIBTPU_ARGS=""
      ;;
    671b)
      ARGS=(model_name=deepseek3-671b compile_topology=v5p-1024 "${RECIPE_671B[@]}")
      LIBTPU_ARGS="${RECIPE_LIBTPU_INIT_ARGS}"
      ;;
    v32)
      # The indexer needs attention=dot_product, or flash with Tokamax's splash kernel (0.2.5's
    # configs/types.py); the indexer's top-k mask is a dense [batch, q, kv] mask.
    ARGS=(model_name=deepseek3.2-671b compile_topology=v5p-1024 "${RECIPE_671B[@]}" max_target_length=4096
      attention=flash use_tokamax_splash=True)
      LIBTPU_ARGS="${RECIPE_LIBTPU_INIT_ARGS}"
      ;;
    *)
      echo "Unknown case '${CASE}'; expected tiny, 671b or v32." >&2
      exit 1
      ;;
  esac
  if [[ "${NO_RECIPE_XLA_FLAGS:-0}" == "1" ]]; then LIBTPU_ARGS=""; fi

  export LIBTPU_INIT_ARGS="${LIBTPU_INIT_ARGS:-}${LIBTPU_ARGS} ${EXTRA_LIBTPU_INIT_ARGS:-}"
  if [[ "${XLA_DUMP:-0}" == "1" ]]; then
    export XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=${OUT_DIR}/${NAME}.xla_dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_train_step"
  fi

  LOG="${OUT_DIR}/${NAME}.log"
  echo "Compiling ${NAME}; log in ${LOG}"
  set +e
  {
    echo "date: $(date -u +%FT%TZ)"
    echo "LIBTPU_INIT_ARGS=${LIBTPU_INIT_ARGS}"
    echo "XLA_FLAGS=${XLA_FLAGS:-}"
    echo "args: ${ARGS[*]} $*"
    /usr/bin/time -v timeout "${TIMEOUT}" "${PY}" "${HERE}/compile_hlo.py" \
      --name="${NAME}" --out_dir="${OUT_DIR}" -- \
      "${BASE_YML}" "${COMMON[@]}" "${ARGS[@]}" "$@"
  } > "${LOG}" 2>&1
  rc=$?
  set -e
  echo "exit status ${rc}"
  grep -E "Maximum resident set size|Elapsed \(wall clock\)" "${LOG}" || true
  return "${rc}"
}

main "$@"; exit $?
