"""The planted bugs of tests/mutants/: each ``NN_name.patch`` changes ``file``; ``tests`` (with ``-k k``)
must catch it. Keep them current: ``python tests/mutants/run.py --check`` says which no longer apply.
Make a patch with ``git diff -U1 -- FILE`` (one line of context, so it keeps applying as nearby code changes)."""

from __future__ import annotations

MUTANTS: list[dict] = [
    {
        "name": "01_zero3_free_point_in_user_order",
        "file": "passes/zero3_gather_free.py",
        "why": (
            "ZeRO-3 frees a group after the last consumer in user order, not the latest in the graph: a "
            "module called twice in a layer (or a weight shared with a later layer) is freed before its last"
            " use"
        ),
        "tests": ["tests/test_mutation_gaps.py"],
        "k": "gathers_each_layer or (test_every_strategy and zero3)",
    },
    {
        "name": "02_clip_coefficient_not_clamped",
        "file": "autoshard/runtime/optim.py",
        "why": "clipping scales gradients up when the norm is already under the limit",
        "tests": ["tests/test_mutation_gaps.py"],
        "k": "clipping and above",
    },
    {
        "name": "03_conv_flops_without_input_channels",
        "file": "passes/cost_model.py",
        "why": "a convolution's FLOPs leave out the input channels per group",
        "tests": ["tests/test_flops.py"],
        "k": "conv",
    },
    {
        "name": "04_bf16_masters_from_rounded_weights",
        "file": "autoshard/runtime/rank.py",
        "why": "fp32 masters start from the bf16-rounded parameters instead of the fp32 originals",
        "tests": ["tests/test_mutation_gaps.py"],
        "k": "bf16",
    },
    {
        "name": "05_dp_gradients_not_divided_by_dp",
        "file": "autoshard/runtime/holders.py",
        "why": ("data parallel sums the ranks' gradients instead of averaging them (Adam hides the factor dp)"),
        "tests": ["tests/test_mutation_gaps.py"],
        "k": "first_update and dp2",
    },
    {
        "name": "06_zero12_gradients_not_divided_by_dp",
        "file": "autoshard/runtime/holders.py",
        "why": "ZeRO-1/2 reduce-scatter sums the ranks' gradients instead of averaging them",
        "tests": ["tests/test_mutation_gaps.py"],
        "k": "first_update and zero1",
    },
    {
        "name": "07_zero3_gradients_not_divided_by_dp",
        "file": "autoshard/runtime/zero.py",
        "why": "ZeRO-3 reduce-scatter sums the ranks' gradients instead of averaging them",
        "tests": ["tests/test_mutation_gaps.py"],
        "k": "first_update and zero3",
    },
    {
        "name": "08_pipeline_loss_not_scaled_by_microbatches",
        "file": "autoshard/runtime/pipeline.py",
        "why": ("the pipeline sums the microbatches' gradients instead of averaging them (the loss is still averaged)"),
        "tests": ["tests/test_mutation_gaps.py"],
        "k": "first_update and pp2",
    },
    {
        "name": "09_zero_shard_offset_ignores_padding",
        "file": "autoshard/runtime/flat.py",
        "why": (
            "a rank's ZeRO shard starts at rank x numel/dp, wrong whenever the group is padded to a multiple of dp"
        ),
        "tests": ["tests/test_mutation_gaps.py"],
        "k": "test_every_strategy and zero1",
    },
    {
        "name": "10_addmm_column_and_row_swapped",
        "file": "autoshard/sharding/matmul.py",
        "why": "addmm's weight is read as W[out, in] (linear's layout): column- and row-parallel swapped",
        "tests": ["tests/test_rules_matmul.py"],
        "k": "addmm",
    },
    {
        "name": "11_schedule_rule2_removed",
        "file": "autoshard/spec/schedules.py",
        "why": (
            "the validator no longer checks rule 2 (forward before backward); the deadlock check refuses "
            "such schedules under another rule"
        ),
        "tests": ["tests/test_schedules.py"],
        "k": "each_rule",
    },
    {
        "name": "12_zero12_last_group_not_gathered",
        "file": "autoshard/runtime/holders.py",
        "why": (
            "after the sharded step the last flat group is not all-gathered: other ranks' updates of it never arrive"
        ),
        "tests": ["tests/test_mutation_gaps.py"],
        "k": "test_every_strategy and zero1",
    },
    {
        "name": "13_masters_not_written_back",
        "file": "autoshard/runtime/masters.py",
        "why": (
            "separate fp32 masters (bf16 parameters, offload) are stepped but never copied back into the parameters"
        ),
        "tests": ["tests/test_mutation_gaps.py"],
        "k": "bf16",
    },
    {
        "name": "14_zero1_gradient_buffer_not_zeroed",
        "file": "autoshard/runtime/holders.py",
        "why": (
            "ZeRO-1 keeps its full gradient buffer between steps but no longer zeroes it, so each step adds "
            "the last one's gradients"
        ),
        "tests": ["tests/test_mutation_gaps.py"],
        "k": "test_every_strategy and zero1",
    },
    {
        "name": "15_loss_not_averaged_over_dp",
        "file": "autoshard/runtime/rank.py",
        "why": "step() returns the sum of the dp ranks' losses instead of their mean",
        "tests": ["tests/test_mutation_gaps.py"],
        "k": "test_every_strategy and dp2",
    },
    {
        "name": "16_loss_counted_on_every_tp_rank",
        "file": "autoshard/runtime/rank.py",
        "why": "the returned loss counts every tp rank's copy of it",
        "tests": ["tests/test_mutation_gaps.py"],
        "k": "test_every_strategy and tp2",
    },
    {
        "name": "17_norm_counts_every_dp_replica",
        "file": "autoshard/runtime/rank.py",
        "why": "the global norm counts each rank's copy of a replicated gradient",
        "tests": ["tests/test_mutation_gaps.py"],
        "k": "clipping and dp2",
    },
    {
        "name": "18_zero3_backward_does_not_regather",
        "file": "autoshard/graph_ops/zero.py",
        "why": "ZeRO-3 backward runs an op's backward without gathering its freed parameters again",
        "tests": ["tests/test_mutation_gaps.py"],
        "k": "test_every_strategy and zero3",
    },
    {
        "name": "19_zero3_free_keeps_gathered_flag",
        "file": "autoshard/runtime/zero.py",
        "why": "freeing a ZeRO-3 group leaves it marked gathered, so backward reads the released buffer",
        "tests": ["tests/test_mutation_gaps.py"],
        "k": "test_every_strategy and zero3",
    },
    {
        "name": "20_global_norm_without_sqrt",
        "file": "autoshard/runtime/optim.py",
        "why": "the global gradient norm is the sum of squares, not its square root",
        "tests": ["tests/test_mutation_gaps.py"],
        "k": "clipping and dp2",
    },
    {
        "name": "21_pipeline_arms_at_first_backward",
        "file": "autoshard/runtime/pipeline.py",
        "why": (
            "a stage's gradient groups are armed before its first backward instead of its last: reduced "
            "before every microbatch is in"
        ),
        "tests": ["tests/test_mutation_gaps.py"],
        "k": "first_update and dp2xpp2",
    },
    {
        "name": "22_tp_copy_backward_not_reduced",
        "file": "autoshard/graph_ops/tp.py",
        "why": "Megatron's f (identity forward) no longer all-reduces the partial input gradients backward",
        "tests": ["tests/test_mutation_gaps.py"],
        "k": "first_update and tp2",
    },
    {
        "name": "23_vocab_cross_entropy_gradient_not_averaged",
        "file": "autoshard/graph_ops/tp.py",
        "why": ("the vocab-parallel cross-entropy's backward forgets the mean over tokens (Adam hides the factor)"),
        "tests": ["tests/test_mutation_gaps.py"],
        "k": "first_update and tp2",
    },
    {
        "name": "24_vocab_embedding_range_off_by_one",
        "file": "autoshard/graph_ops/tp.py",
        "why": "the vocab-parallel embedding takes the first id of the next rank's rows as its own",
        "tests": ["tests/test_mutation_gaps.py"],
        "k": "first_update and tp2",
    },
    {
        "name": "25_reduce_scatter_to_group_ranks",
        "file": "autoshard/distributed/comm.py",
        "why": (
            "gloo's chunked reduce-scatter and all-gather address ranks by their index in the group, not "
            "their global rank"
        ),
        "tests": ["tests/test_mutation_gaps.py"],
        "k": "test_every_strategy and dp2xtp2",
    },
    {
        "name": "26_norm_counts_tp_replicas",
        "file": "autoshard/ir/placements.py",
        "why": "the global norm counts a tp-replicated weight's gradient on every tp rank",
        "tests": ["tests/test_mutation_gaps.py"],
        "k": "clipping and tp2",
    },
    {
        "name": "27_placeholders_require_grad",
        "file": "passes/shape_prop.py",
        "why": (
            "shape_prop marks data inputs as needing gradients, so backward FLOPs count an input gradient "
            "nobody computes"
        ),
        "tests": ["tests/test_flops.py"],
        "k": None,
    },
    {
        "name": "28_layer_name_drops_block_index",
        "file": "passes/layer_assign.py",
        "why": "layer names stop before a block's index, so every block of a ModuleList is one layer",
        "tests": ["tests/test_pipeline_split.py"],
        "k": "identical",
    },
    {
        "name": "29_attention_flops_query_width_twice",
        "file": "passes/cost_model.py",
        "why": "attention FLOPs use the query width for the value product too",
        "tests": ["tests/test_flops.py"],
        "k": "attention",
    },
    {
        "name": "30_addmm_flops_contract_over_the_bias",
        "file": "passes/cost_model.py",
        "why": "addmm/baddbmm FLOPs read the operands one place early (the bias as the left factor)",
        "tests": ["tests/test_flops.py"],
        "k": "bmm or products",
    },
    {
        "name": "31_row_parallel_never_chosen",
        "file": "passes/tp_placement.py",
        "why": ("the search never recognises a linear fed sharded features, so no weight becomes row-parallel"),
        "tests": ["tests/test_tp.py"],
        "k": "megatron_style or fused_qkv",
    },
    {
        "name": "32_view_sizes_not_made_local",
        "file": "passes/tp_rewrite.py",
        "why": "literal sizes in views keep their global value on sharded dimensions (heads x head_dim)",
        "tests": ["tests/test_tp.py"],
        "k": "megatron_style",
    },
    {
        "name": "33_sequence_parallel_bias_not_split",
        "file": "passes/tp_rewrite.py",
        "why": (
            "under sequence parallelism a row-parallel bias is added whole on every rank, then reduce-"
            "scattered: tp times the bias"
        ),
        "tests": ["tests/test_mutation_gaps.py"],
        "k": "first_update and tp2-sp",
    },
    {
        "name": "34_pipeline_cuts_least_balanced",
        "file": "passes/pipeline_split.py",
        "why": "the stage-cut search keeps the worst balanced cuts",
        "tests": ["tests/test_pipeline_split.py"],
        "k": "identical",
    },
    {
        "name": "35_pipeline_sends_input_only_values",
        "file": "passes/pipeline_stages.py",
        "why": ("masks and positions computed from the inputs alone are sent across cuts instead of recomputed"),
        "tests": ["tests/test_pipeline.py"],
        "k": "stage_graphs_show_send_and_recv",
    },
    {
        "name": "36_bucket_overfills_by_one_parameter",
        "file": "passes/grad_buckets.py",
        "why": "a gradient bucket is closed only once it is already over its size, so it exceeds bucket_mb",
        "tests": ["tests/test_passes.py"],
        "k": "buckets_partition",
    },
    {
        "name": "37_zero3_groups_ignore_layers",
        "file": "passes/zero_groups.py",
        "why": "ZeRO-3 gathers the whole model as one group instead of one group per layer",
        "tests": ["tests/test_mutation_gaps.py"],
        "k": "gathers_each_layer",
    },
    {
        "name": "38_pass_writes_checked_only_on_new_graphs",
        "file": "passes/infra.py",
        "why": ("the pass manager checks a pass's promised keys only on graphs it made, not on the graph it ran on"),
        "tests": ["tests/test_passes.py"],
        "k": "every_pass_declares",
    },
    {
        "name": "39_view_split_shards_inner_dimension",
        "file": "autoshard/sharding/views.py",
        "why": (
            "a view that splits a sharded dimension puts the shard on the innermost part (head_dim) instead "
            "of the outermost (heads)"
        ),
        "tests": ["tests/test_tp.py"],
        "k": "megatron_style or fused_qkv",
    },
    {
        "name": "40_fused_split_not_strided",
        "file": "autoshard/sharding/views.py",
        "why": (
            "a split into equal parts of a sharded value no longer asks for a strided shard: fused QKV gives"
            " each rank wrong q, k, v"
        ),
        "tests": ["tests/test_tp.py"],
        "k": "fused_qkv",
    },
    {
        "name": "41_bmm_contraction_not_partial",
        "file": "autoshard/sharding/matmul.py",
        "why": ("bmm/matmul with the contracted dimension split claims a replicated result instead of partial sums"),
        "tests": ["tests/test_rules_matmul.py"],
        "k": "bmm or matmul",
    },
    {
        "name": "42_attention_mask_per_head_inverted",
        "file": "autoshard/sharding/reductions.py",
        "why": ("attention asks for a mask shared by all heads to be sharded by heads, and a per-head mask whole"),
        "tests": ["tests/test_rules_matmul.py"],
        "k": "attention",
    },
    {
        "name": "43_planner_zero3_keeps_full_gradients",
        "file": "autoshard/planner/memory.py",
        "why": "the planner's memory model keeps ZeRO-3's full gradients after each group's reduce-scatter",
        "tests": ["tests/test_planner_rules.py"],
        "k": None,
    },
    {
        "name": "44_planner_misses_the_deepest_pipeline",
        "file": "autoshard/planner/degrees.py",
        "why": "the planner's factorizations leave out pp = world / tp (dp = 1)",
        "tests": ["tests/test_planner_rules.py"],
        "k": None,
    },
    {
        "name": "45_planner_fewest_microbatches",
        "file": "autoshard/planner/degrees.py",
        "why": ("the default microbatch count is the fewest that divide a rank's rows, not the most (up to 4 x pp)"),
        "tests": ["tests/test_planner_rules.py"],
        "k": None,
    },
    {
        "name": "46_schedule_dependency_in_the_same_step",
        "file": "autoshard/spec/schedules.py",
        "why": ("the schedule simulation lets an action run in the same time step as the action it waits for"),
        "tests": ["tests/test_schedules.py"],
        "k": "bubble",
    },
    {
        "name": "47_dropout_masks_rows_of_the_first_dp_rank",
        "file": "autoshard/graph_ops/masks.py",
        "why": "single-device dropout masks: every dp rank keeps the first dp rank's rows of the global mask",
        "tests": ["tests/test_dropout_masks.py"],
        "k": "microbatches_slice",
    },
    {
        "name": "48_dropout_masks_later_stages_not_drawn",
        "file": "autoshard/graph_ops/masks.py",
        "why": (
            "single-device dropout masks: a step ends without drawing the later pipeline stages' masks, so "
            "earlier stages' ranks fall out of the shared random sequence"
        ),
        "tests": ["tests/test_dropout_masks.py"],
        "k": "microbatches_slice",
    },
    {
        "name": "49_verify_partial_values_not_summed",
        "file": "autoshard/inspection/node_values.py",
        "why": "verify takes one rank's partial sum as the full value of a node partial over tp",
        "tests": ["tests/test_verify.py"],
        "k": "no_divergence_under_tp_and_pp",
    },
    {
        "name": "50_mfu_ignores_the_world_size",
        "file": "autoshard/inspection/metrics.py",
        "why": "MFU divides the whole mesh's FLOPs by one device's peak (the world size left out)",
        "tests": ["tests/test_metrics.py"],
        "k": "metrics_and_trace",
    },
    {
        "name": "51_wait_right_after_its_collective",
        "file": "passes/overlap_comm.py",
        "why": "each wait_tensor is placed right after its collective, so nothing overlaps the communication",
        "tests": ["tests/test_compiled.py"],
        "k": "graphs_hold",
    },
    {
        "name": "52_compiled_buckets_not_divided_by_dp",
        "file": "passes/graph_buckets.py",
        "why": "a bucket reduced in the compiled backward graph is summed over dp instead of averaged",
        "tests": ["tests/test_compiled.py"],
        "k": "graphs_hold",
    },
    {
        "name": "53_reduce_dtype_ignored",
        "file": "autoshard/runtime/holders.py",
        "why": "gradients are reduced in their own dtype whatever the plan's reduce_dtype says",
        "tests": ["tests/test_compiled.py"],
        "k": "reduce_dtype",
    },
    {
        "name": "54_simulated_schedule_ignores_what_it_waits_for",
        "file": "autoshard/planner/simulate.py",
        "why": "the planner's schedule simulation starts an action before the one it receives from finished",
        "tests": ["tests/test_planner_rules.py"],
        "k": "textbook_bubble",
    },
    {
        "name": "55_profile_counts_a_tied_weight_twice",
        "file": "autoshard/planner/profile.py",
        "why": "a weight tied across parts (GPT-2's embedding and head) counts in every part that reads it",
        "tests": ["tests/test_planner_rules.py"],
        "k": "zero_formulas",
    },
    {
        "name": "56_every_program_makes_new_process_groups",
        "file": "autoshard/distributed/groups.py",
        "why": "every compile creates new process groups that are never destroyed: a long-lived process leaks them",
        "tests": ["tests/test_dp_runtime.py"],
        "k": "share_their_process_groups",
    },
    {
        "name": "57_zero3_costed_as_one_bucket_of_calls",
        "file": "autoshard/planner/costing.py",
        "why": "ZeRO-3's gathers and reduce-scatters are costed as few calls as DP's buckets, not one per layer group",
        "tests": ["tests/test_planner_rules.py"],
        "k": "each_gather_group",
    },
    {
        "name": "58_shared_ranks_never_compute_faster",
        "file": "autoshard/planner/simulate.py",
        "why": "ranks that share processors compute at their share even while the pipeline's other ranks wait",
        "tests": ["tests/test_planner_rules.py"],
        "k": "share_processors",
    },
    {
        "name": "59_blocks_configured_apart_stamped",
        "file": "autoshard/capture/blocks.py",
        "why": "blocks whose attributes differ (sliding-window layers every few blocks) are stamped as copies",
        "tests": ["tests/test_capture_blocks.py"],
        "k": "configured_apart",
    },
    {
        "name": "60_stamped_blocks_read_the_last_traced_block",
        "file": "autoshard/capture/blocks.py",
        "why": (
            "every stamped block reads the last traced block's output instead of the block before it (a check "
            "against a three-block trace cannot see it: only the stamped depth can)"
        ),
        "tests": ["tests/test_capture_blocks.py"],
        "k": "full_trace",
    },
    {
        "name": "61_checkpoint_restores_the_kernel_choice",
        "file": "autoshard/checkpoint/__init__.py",
        "why": (
            "a checkpoint saved on the fused kernel puts the loading program on that kernel too, though its "
            "step counts were loaded on the host (a fused kernel on a GPU wants them on the device)"
        ),
        "tests": ["tests/test_compiled.py"],
        "k": "carries_training_state",
    },
    {
        "name": "62_fused_kernel_overrides_the_users_choice",
        "file": "autoshard/runtime/optim.py",
        "why": (
            "torch_compile=True puts an optimizer on the fused kernel although the user chose fused=False or foreach"
        ),
        "tests": ["tests/test_compiled.py"],
        "k": "fused_kernel_only_where",
    },
    {
        "name": "63_planner_gradient_accumulation_one_pass",
        "file": "autoshard/planner/part_times.py",
        "why": "a backward's gradient accumulation is costed as one pass over the gradients, not two reads and a write",
        "tests": ["tests/test_planner_rules.py"],
        "k": "adds_its_gradients",
    },
    {
        "name": "64_cpu_matmul_hides_its_operand_pass",
        "file": "autoshard/planner/hardware.py",
        "why": "a CPU matmul overlaps its operand pass with its FLOPs (the slower of the two), as a GPU kernel does",
        "tests": ["tests/test_planner_rules.py"],
        "k": "operand_pass",
    },
    {
        "name": "65_planner_optimizer_not_slowed_by_shared_processors",
        "file": "autoshard/planner/costing.py",
        "why": "ranks that share processors step their optimizers at once but the cost model times each as if alone",
        "tests": ["tests/test_planner_rules.py"],
        "k": "step_their_optimizers",
    },
    {
        "name": "66_planner_adam_costed_as_a_fused_kernel",
        "file": "autoshard/planner/costing.py",
        "why": "Adam costed as a fused kernel's 7 fp32 values an element, not the 20 torch's AdamW moves",
        "tests": ["tests/test_planner_rules.py"],
        "k": "optimizer",
    },
    {
        "name": "67_planner_vocab_parallel_loss_costs_no_collectives",
        "file": "autoshard/planner/part_graph.py",
        "why": "the vocab-parallel loss's own all-reduces (row max; sum of exponentials and target logit) go uncosted",
        "tests": ["tests/test_planner_rules.py"],
        "k": "tensor_parallel_rank_issues",
    },
    {
        "name": "68_planner_partial_output_handed_on_unreduced",
        "file": "autoshard/planner/part_graph.py",
        "why": "a part that hands on a partial sum (the embedding's) is costed without the all-reduce its reader makes",
        "tests": ["tests/test_planner_rules.py"],
        "k": "tensor_parallel_rank_issues",
    },
    {
        "name": "69_sync_wait_alike_in_every_group_size",
        "file": "autoshard/planner/hardware.py",
        "why": "a pair of ranks is costed the arrival wait of the largest group measured, not of its own size",
        "tests": ["tests/test_planner_rules.py"],
        "k": "group_size_was_measured",
    },
    {
        "name": "70_planner_partial_gradients_summed_every_microbatch",
        "file": "autoshard/planner/costing.py",
        "why": "sequence parallel's sum of partial gradients is costed once a microbatch, not once a step",
        "tests": ["tests/test_planner_rules.py"],
        "k": "once_a_step",
    },
    {
        "name": "71_permute_shard_follows_the_inverse",
        "file": "autoshard/sharding/views.py",
        "why": "a permute's shard follows the inverse permutation: right for attention's swaps, wrong for a cycle",
        "tests": ["tests/test_rule_oracles.py"],
        "k": "test_the_rule_holds and permute",
    },
    {
        "name": "72_transpose_moves_only_its_first_dim",
        "file": "autoshard/sharding/views.py",
        "why": "a transpose moves a shard on its first dimension but leaves one on its second where it was",
        "tests": ["tests/test_rule_oracles.py"],
        "k": "test_the_rule_holds and transpose",
    },
    {
        "name": "73_unsqueeze_at_the_shard_keeps_it_in_place",
        "file": "autoshard/sharding/views.py",
        "why": "a dimension inserted at the sharded one leaves the shard on the new size-1 dimension",
        "tests": ["tests/test_rule_oracles.py"],
        "k": "test_the_rule_holds and unsqueeze",
    },
    {
        "name": "74_reduction_shifts_the_shard_under_keepdim",
        "file": "autoshard/sharding/reductions.py",
        "why": "a reduction with keepdim=True shifts the shard down as if the reduced dimensions were gone",
        "tests": ["tests/test_rule_oracles.py"],
        "k": "test_the_rule_holds and (amax or mean or sum)",
    },
    {
        "name": "75_partial_plus_a_number_stays_partial",
        "file": "autoshard/sharding/pointwise.py",
        "why": "a partial value plus a number stays partial: every rank adds it, so the sum adds it tp times",
        "tests": ["tests/test_rule_oracles.py"],
        "k": "test_the_rule_holds and (add or sub)",
    },
    {
        "name": "76_addmm_bias_sharded_on_its_first_dim",
        "file": "autoshard/sharding/matmul.py",
        "why": "a column-parallel addmm shards a [1, n] or [m, n] bias on its rows, not its features",
        "tests": ["tests/test_rule_oracles.py"],
        "k": "test_the_rule_holds and addmm",
    },
    {
        "name": "77_reduce_scatter_into_a_strided_shard_drops_its_blocks",
        "file": "passes/tp_rewrite.py",
        "why": "a partial value reduce-scattered into a strided shard (fused q, k, v) is cut into plain slices",
        "tests": ["tests/test_rule_oracles.py"],
        "k": "test_the_rule_holds",
    },
    {
        "name": "78_size_of_a_sharded_dim_left_local",
        "file": "passes/tp_rewrite.py",
        "why": "a size read off a sharded dimension is the rank's part, though the rule promises the whole tensor's",
        "tests": ["tests/test_rule_oracles.py"],
        "k": "test_the_rule_holds and sym_size",
    },
    {
        "name": "79_tied_weight_loads_its_own_keys_master_only",
        "file": "autoshard/checkpoint/__init__.py",
        "why": "a tied weight loaded from a checkpoint with fp32 masters takes its second key's rounded bf16 value",
        "tests": ["tests/test_state_matrix.py"],
        "k": "bf16-plain-checkpoint",
    },
    {
        "name": "80_loaded_state_dict_rounds_the_masters",
        "file": "autoshard/runtime/holders.py",
        "why": "load_state_dict into a plan with bf16 parameters rounds the fp32 values its masters should keep",
        "tests": ["tests/test_state_matrix.py"],
        "k": "zero3-bf16-state_dict",
    },
    {
        "name": "81_full_state_dict_ignores_masters",
        "file": "autoshard/program/across_ranks.py",
        "why": "full_state_dict(masters=True) hands over the rounded bf16 parameters, not the fp32 masters",
        "tests": ["tests/test_state_matrix.py"],
        "k": "bf16-zero3-offload-tp-state_dict",
    },
    {
        "name": "82_planner_masters_not_sharded_by_zero",
        "file": "autoshard/planner/memory.py",
        "why": "the planner charges every rank all the fp32 masters, which ZeRO shards over dp",
        "tests": ["tests/test_planner_closed_forms.py"],
        "k": "model_states",
    },
    {
        "name": "83_planner_zero3_accumulation_keeps_two_layers_of_gradients",
        "file": "autoshard/planner/memory.py",
        "why": "ZeRO-3 under gradient accumulation is charged two layers of gradients, not the whole buffers it keeps",
        "tests": ["tests/test_planner_closed_forms.py"],
        "k": "model_states",
    },
    {
        "name": "84_planner_reduction_hides_behind_every_microbatch",
        "file": "autoshard/planner/costing.py",
        "why": "the gradient reduction hides behind every microbatch's backward, though it starts in the last one's",
        "tests": ["tests/test_planner_closed_forms.py"],
        "k": "hides_behind",
    },
    {
        "name": "85_planner_offload_moves_every_master",
        "file": "autoshard/planner/costing.py",
        "why": "offload is charged moving every master across the host link, not this rank's ZeRO shard",
        "tests": ["tests/test_planner_closed_forms.py"],
        "k": "offloaded_step",
    },
    {
        "name": "86_planner_tied_weight_by_its_dangling_name",
        "file": "autoshard/planner/profile.py",
        "why": "the profile charges a tied weight by a name the part never reads (whole), not the one it shards",
        "tests": ["tests/test_planner_closed_forms.py"],
        "k": "model_states",
    },
    {
        "name": "87_verify_checks_one_copy_of_a_replicated_value",
        "file": "autoshard/inspection/node_values.py",
        "why": "verify compares a replicated value on the first tensor-parallel rank only",
        "tests": ["tests/test_verify.py"],
        "k": "replicated",
    },
    {
        "name": "88_mfu_peak_ignores_the_models_dtype",
        "file": "autoshard/inspection/metrics.py",
        "why": "MFU of a model already in bf16 (the plan casting nothing) is taken against the fp32 peak",
        "tests": ["tests/test_metrics.py"],
        "k": "dtype_the_matmuls",
    },
    {
        "name": "89_cli_switch_words_taken_as_strings",
        "file": "autoshard/cli.py",
        "why": "--plan offload=true (or yes, on, 1) reaches the plan as a string",
        "tests": ["tests/test_cli.py"],
        "k": "plan_words",
    },
    {
        "name": "90_data_check_misses_the_global_batch_everywhere",
        "file": "autoshard/program/data.py",
        "why": "the global batch handed to every data-parallel rank trains each on all of it, unchecked",
        "tests": ["tests/test_data_per_rank.py"],
        "k": "global_batch",
    },
    {
        "name": "91_zero_bubble_counts_a_held_back_weight_in_b",
        "file": "autoshard/runtime/launcher.py",
        "why": "the empty accumulation autograd runs for a weight whose gradient B held back counts as its arrival",
        "tests": ["tests/test_zero_bubble.py"],
        "k": "on_its_edges and dp2",
    },
    {
        "name": "92_zero_bubble_every_w_completes_its_stage",
        "file": "autoshard/runtime/pipeline.py",
        "why": "an earlier microbatch's W after the stage's last B counts as the weights' final arrival",
        "tests": ["tests/test_zero_bubble.py"],
        "k": "on_its_edges and dp2",
    },
    {
        "name": "93_zb_h1_holds_one_w_too_many",
        "file": "autoshard/spec/schedule_builders.py",
        "why": "ZB-H1 keeps one W more than its rank index back: more activations than 1F1B's first rank",
        "tests": ["tests/test_zero_bubble.py"],
        "k": "holds_at_most",
    },
    {
        "name": "94_v_placement_off_by_one",
        "file": "autoshard/spec/schedules.py",
        "why": "the V's way back up puts each stage one rank off",
        "tests": ["tests/test_zero_bubble.py"],
        "k": "zbv_is_valid",
    },
    {
        "name": "95_zbv_holds_more_than_1f1b",
        "file": "autoshard/spec/schedule_builders.py",
        "why": "ZBV warms up with two more forwards down the V than 2(pp-r)-1, past 1F1B's first rank's activations",
        "tests": ["tests/test_zero_bubble.py"],
        "k": "zbv_is_valid",
    },
    {
        "name": "96_loss_taken_where_the_last_stage_is_not",
        "file": "autoshard/runtime/rank.py",
        "why": "the step's loss is read on pp rank pp-1, where a V pipeline's last stage is not",
        "tests": ["tests/test_zero_bubble.py"],
        "k": "on_its_edges and gpt2-pp4",
    },
    {
        "name": "97_zero3_zero_bubble_armed_at_last_b",
        "file": "autoshard/runtime/rank.py",
        "why": "ZeRO-3 under a zero-bubble schedule arms at the last B: every later W reduce-scatters again",
        "tests": ["tests/test_zero_bubble.py"],
        "k": "bit_for_bit and zero3",
    },
    {
        "name": "98_zero3_w_keeps_one_matmuls_gradient_of_a_weight",
        "file": "autoshard/graph_ops/weight_grad.py",
        "why": "a ZeRO-3 W keeps the last of several matmuls' gradients of one weight instead of their sum",
        "tests": ["tests/test_mutation_gaps.py"],
        "k": "reuse and zero3-zb_h1",
    },
    {
        "name": "99_an_earlier_w_overwrites_the_gradient",
        "file": "autoshard/graph_ops/weight_grad.py",
        "why": "a W before the stage's last one writes over the earlier microbatches' weight gradients",
        "tests": ["tests/test_zero_bubble.py"],
        "k": "edges and gpt2-pp2-recompute",
    },
    {
        "name": "100_zb_h2_holds_past_its_bound",
        "file": "autoshard/spec/schedule_builders.py",
        "why": "ZB-H2 starts forwards past 2pp-1 microbatches held",
        "tests": ["tests/test_zero_bubble.py"],
        "k": "zb_h2_warms_up",
    },
    {
        "name": "101_grouped_matmul_costs_every_expert",
        "file": "passes/cost_model.py",
        "why": "a grouped matmul costs every row through every group's matrix, not its own",
        "tests": ["tests/test_flops.py"],
        "k": "grouped or mixture",
    },
    {
        "name": "102_expert_grads_reduced_over_all_dp",
        "file": "autoshard/runtime/holders.py",
        "why": (
            "data parallelism all-reduces an expert's gradient over every dp rank, summing different experts' gradients"
        ),
        "tests": ["tests/test_experts.py"],
        "k": "torch_compile",
    },
    {
        "name": "103_expert_grads_divided_by_their_replicas",
        "file": "autoshard/runtime/holders.py",
        "why": (
            "ZeRO divides an expert's gradient by the dp / ep ranks holding it, not by dp (the mean over the "
            "global batch)"
        ),
        "tests": ["tests/test_experts.py"],
        "k": "tensor_parallelism and ep2",
    },
    {
        "name": "104_dispatch_keeps_rows_by_source",
        "file": "autoshard/graph_ops/experts.py",
        "why": (
            "dispatched rows stay ordered by source rank, so the grouped matmuls' offs point into other experts' rows"
        ),
        "tests": ["tests/test_experts.py"],
        "k": "clipping",
    },
    {
        "name": "105_expert_norm_counted_on_one_rank",
        "file": "autoshard/ir/placements.py",
        "why": "the global norm counts only dp rank 0's experts, leaving out the other ep ranks'",
        "tests": ["tests/test_experts.py"],
        "k": "clipping",
    },
    {
        "name": "106_experts_broadcast_from_first_dp_rank",
        "file": "autoshard/runtime/rank.py",
        "why": "set-up broadcasts every tensor from the first dp rank, so every ep rank holds the first rank's experts",
        "tests": ["tests/test_experts.py"],
        "k": "zero3_and_accumulation",
    },
    {
        "name": "107_expert_region_takes_any_op",
        "file": "passes/expert_parallel.py",
        "why": "the expert region takes an op that mixes rows (a mean over all rows), which dispatch changes",
        "tests": ["tests/test_experts.py"],
        "k": "refusals",
    },
    {
        "name": "108_row_parallel_experts_not_partial",
        "file": "autoshard/sharding/matmul.py",
        "why": "a row-parallel grouped matmul's output is taken as whole, not a partial sum",
        "tests": ["tests/test_rule_oracles.py"],
        "k": "grouped",
    },
    {
        "name": "109_checkpoint_forgets_the_expert_cut",
        "file": "autoshard/checkpoint/regions.py",
        "why": "a checkpoint stores a tensor cut by tp and ep at its tp cut only, overwriting other ranks' experts",
        "tests": ["tests/test_experts.py"],
        "k": "checkpoint_reshards",
    },
    {
        "name": "110_batch_statistic_divided_by_the_local_count",
        "file": "passes/batch_statistics.py",
        "why": "a sum over every dp rank's rows is divided by this rank's count of rows",
        "tests": ["tests/test_experts.py"],
        "k": "balancing",
    },
    {
        "name": "111_batch_statistic_gradient_left_local",
        "file": "autoshard/graph_ops/batch_stats.py",
        "why": "a statistic summed over dp in forward takes only this rank's gradient in backward",
        "tests": ["tests/test_experts.py"],
        "k": "balancing",
    },
    {
        "name": "112_loop_experts_held_by_every_rank",
        "file": "autoshard/ir/placements.py",
        "why": "every rank holds every expert of a loop over experts (nothing released: no memory saved)",
        "tests": ["tests/test_experts.py"],
        "k": "loop_over_experts and ep2",
    },
    {
        "name": "113_loop_slots_keep_the_first_experts",
        "file": "autoshard/runtime/expert_parallel.py",
        "why": "every rank runs the first E / ep experts of a loop in its slots, not its own",
        "tests": ["tests/test_experts.py"],
        "k": "loop_over_experts and ep2",
    },
    {
        "name": "114_loop_slots_take_rows_by_source_rank",
        "file": "autoshard/graph_ops/experts.py",
        "why": "a loop's slots take the dispatched rows split by source rank, not by local expert",
        "tests": ["tests/test_experts.py"],
        "k": "loop_over_experts and ep2",
    },
    {
        "name": "115_loop_experts_not_compared",
        "file": "passes/expert_loops.py",
        "why": "experts of a loop that compute differently run in each other's slots",
        "tests": ["tests/test_experts.py"],
        "k": "refusals",
    },
    {
        "name": "116_loop_expert_norm_on_the_first_ep_rank_only",
        "file": "autoshard/ir/placements.py",
        "why": "the global norm counts a loop's experts on dp rank 0 only, leaving out the other ep ranks' experts",
        "tests": ["tests/test_experts.py"],
        "k": "clipping and moe_loop",
    },
    {
        "name": "117_loop_expert_laid_out_as_itself",
        "file": "autoshard/compiler/placements.py",
        "why": "another rank's expert of a loop gets its own (unread: replicated) tp layout, not its slot's",
        "tests": ["tests/test_experts.py"],
        "k": "loop_over_experts and tp2",
    },
    {
        "name": "118_selective_takes_every_attention",
        "file": "passes/recompute.py",
        "why": "selective recomputation takes every attention run that frees a byte, a fused kernel too",
        "tests": ["tests/test_recompute.py"],
        "k": "kernels_keep",
    },
    {
        "name": "119_recompute_deal_forgets_the_kept_inputs",
        "file": "passes/recompute_budget.py",
        "why": "what a recompute region frees leaves out that its inputs are then kept",
        "tests": ["tests/test_recompute.py"],
        "k": "kernels_keep",
    },
    {
        "name": "120_recompute_budget_read_as_the_share_to_free",
        "file": "passes/recompute_budget.py",
        "why": "a recompute budget is taken as the share of bytes to free, not to keep",
        "tests": ["tests/test_recompute.py"],
        "k": "budget_keeps",
    },
    {
        "name": "121_recompute_budget_front_cannot_stop_early",
        "file": "passes/recompute_budget.py",
        "why": "a block's front leaves out recomputing nothing from a point on, so every block recomputes from its "
        "start to its end and a budget keeps far less than it may",
        "tests": ["tests/test_recompute.py"],
        "k": "budget_keeps",
    },
    {
        "name": "122_selective_takes_the_models_checkpoints_apart",
        "file": "passes/recompute.py",
        "why": "selective recomputation and budgets weigh a model's own checkpointed regions as runs, dropping them",
        "tests": ["tests/test_recompute.py"],
        "k": "own_checkpoints",
    },
    {
        "name": "123_ring_reads_the_hidden_half_of_an_earlier_block",
        "file": "autoshard/graph_ops/ring_attention.py",
        "why": "under is_causal a block of an earlier rank is read by its second chunk of keys, which the mask hides",
        "tests": ["tests/test_context_parallel.py"],
        "k": "ring_attention_equals or causal_sdpa",
    },
    {
        "name": "124_cp_token_mean_over_each_ranks_own_count",
        "file": "autoshard/graph_ops/context.py",
        "why": "cross-entropy under cp divides by each rank's own count of tokens, not the global count",
        "tests": ["tests/test_context_parallel.py"],
        "k": "trains_as_one_device",
    },
    {
        "name": "125_cp_chunks_not_head_tail",
        "file": "autoshard/graph_ops/context.py",
        "why": "a rank's second chunk is chunk cp+i, not 2cp-1-i: positions no longer cover the sequence",
        "tests": ["tests/test_context_parallel.py"],
        "k": "chunk_positions or ring_attention_equals",
    },
    {
        "name": "126_cp_loss_left_as_the_ranks_share",
        "file": "autoshard/graph_ops/context.py",
        "why": "the loss leaves the graph as the rank's share, so the mean over dp x cp divides it by cp again",
        "tests": ["tests/test_context_parallel.py"],
        "k": "trains_as_one_device",
    },
    {
        "name": "127_cp_sum_over_tokens_backward_unscaled",
        "file": "autoshard/graph_ops/context.py",
        "why": "a sum over tokens all-reduced over cp passes its gradient back unscaled (the runtime divides it by cp)",
        "tests": ["tests/test_context_parallel.py"],
        "k": "mean_over_tokens",
    },
    {
        "name": "128_all_to_all_tokens_out_of_order",
        "file": "autoshard/graph_ops/context.py",
        "why": "all-to-all attention places each rank's tokens at another rank's positions",
        "tests": ["tests/test_context_parallel.py"],
        "k": "all_to_all_attention_equals",
    },
    {
        "name": "129_cp_flatten_keeps_the_outer_dimension",
        "file": "autoshard/sharding/sequence.py",
        "why": "flatten of [batch, tokens] keeps the shard when the batch, not the tokens, is sharded",
        "tests": ["tests/test_context_parallel.py"],
        "k": "causal_sdpa",
    },
    {
        "name": "130_replica_index_collides",
        "file": "autoshard/spec/mesh.py",
        "why": "two ranks of dp x cp get the same place among the ranks holding the same parameters",
        "tests": ["tests/test_context_parallel.py"],
        "k": "mesh_puts or llama-cp4 or dp2-cp2",
    },
    {
        "name": "131_eager_attention_folded_without_its_mask",
        "file": "passes/eager_attention.py",
        "why": "attention written out is folded into SDPA without the masks the chain added",
        "tests": ["tests/test_context_parallel.py"],
        "k": "folded",
    },
    {
        "name": "132_first_bucket_as_large_as_the_others",
        "file": "passes/grad_buckets.py",
        "why": "the first gradient bucket fills to bucket_mb, so its all-reduce waits for a whole bucket of gradients",
        "tests": ["tests/test_passes.py"],
        "k": "buckets_partition",
    },
    {
        "name": "133_later_microbatches_accumulate_outside_the_bucket",
        "file": "autoshard/runtime/holders.py",
        "why": "a first gradient is copied into its bucket but .grad stays the fresh tensor, so the next "
        "microbatches add to it and the bucket reduces the first microbatch's alone",
        "tests": ["tests/test_recompute.py"],
        "k": "accumulation_syncs_once and dp4",
    },
    {
        "name": "134_stage_split_ignores_the_embedding_and_head",
        "file": "autoshard/planner/costing.py",
        "why": "the planner balances pipeline stages over the blocks alone, so the end stages get as many blocks "
        "as the others on top of the embedding and the head",
        "tests": ["tests/test_planner_rules.py"],
        "k": "ends_take_fewer_blocks",
    },
    {
        "name": "135_uneven_interleaving_refused_when_asked",
        "file": "autoshard/planner/search.py",
        "why": "a user asking for interleaving over blocks that do not divide into pp x virtual_stages is refused",
        "tests": ["tests/test_planner_rules.py"],
        "k": "divide_evenly_when_asked",
    },
    {
        "name": "136_sequence_parallel_inputs_kept_whole",
        "file": "passes/saved_tensors.py",
        "why": "the planner counts a sequence-parallel block's kept input whole, t times what a rank keeps",
        "tests": ["tests/test_planner_rules.py"],
        "k": "sequence_shard",
    },
    {
        "name": "137_search_tries_no_budget",
        "file": "autoshard/planner/search.py",
        "why": "the search never tries a recomputation budget, so full recomputation stays where a budget fits",
        "tests": ["tests/test_planner_rules.py"],
        "k": "tries_recompute_budgets",
    },
    {
        "name": "138_budget_grid_rounds_up",
        "file": "passes/recompute_budget.py",
        "why": "the budget knapsack rounds a block's bytes freed up to the grid, so a chosen set can fall short of "
        "the budget",
        "tests": ["tests/test_recompute.py"],
        "k": "knapsack",
    },
    {
        "name": "139_fused_attention_keeps_the_boolean_mask",
        "file": "passes/saved_tensors.py",
        "why": "fused attention is counted keeping a boolean mask once, not its additive copy in q's dtype each call",
        "tests": ["tests/test_saved_tensors.py"],
        "k": "without_dropout and sdpa",
    },
    {
        "name": "140_fused_attention_output_copied_by_reshape",
        "file": "autoshard/ir/ops.py",
        "why": "the transpose-and-reshape after fused attention is counted as a copy kept apart, though the "
        "kernel's output is token-major and it is a view",
        "tests": ["tests/test_saved_tensors.py"],
        "k": "without_dropout and sdpa",
    },
    {
        "name": "141_dropout_at_zero_keeps_a_copy",
        "file": "autoshard/ir/ops.py",
        "why": "a dropout at p = 0 in training is counted as a new tensor, though aten returns its input itself",
        "tests": ["tests/test_saved_tensors.py"],
        "k": "without_dropout and eager",
    },
    {
        "name": "142_a_schedule_answered_with_pp1",
        "file": "autoshard/planner/search.py",
        "why": "a pipeline schedule asked for in an open search is answered with pp=1 plans, which run none",
        "tests": ["tests/test_planner_rules.py"],
        "k": "schedule_asked or refusal_names",
    },
    {
        "name": "143_the_loss_holds_its_logits_gradient_once",
        "file": "passes/gradients_in_flight.py",
        "why": "a loss's backward is counted holding one tensor of its logits' size, not the gradients of its "
        "log-softmax and of the logits at once",
        "tests": ["tests/test_saved_tensors.py"],
        "k": "planners_memory",
    },
    {
        "name": "144_the_peak_leaves_out_gradients_in_flight",
        "file": "autoshard/planner/memory.py",
        "why": "the planner's peak is what is kept and a layer's backward only, never the loss's gradients",
        "tests": ["tests/test_saved_tensors.py"],
        "k": "planners_memory",
    },
    {
        "name": "145_the_budget_knapsack_solved_once",
        "file": "passes/recompute_budget.py",
        "why": "the knapsack is not solved again for what neighbouring blocks free together, so a budget keeps "
        "well under its share at more work",
        "tests": ["tests/test_recompute.py"],
        "k": "keeps_at_most_its_share",
    },
    {
        "name": "146_zero3_layer_phase_added_to_the_loss_phase",
        "file": "autoshard/planner/memory.py",
        "why": "ZeRO-3's peak in the loss's backward counts a gathered layer and its gradients, which come later",
        "tests": ["tests/test_planner_rules.py"],
        "k": "holds_nothing_gathered",
    },
    {
        "name": "147_a_microbatch_in_b_counts_once",
        "file": "autoshard/spec/schedules.py",
        "why": "a split backward's microbatch in its B is counted with its activations only, not also with the "
        "gradients its W will read",
        "tests": ["tests/test_zero_bubble.py"],
        "k": "split_backward_holds",
    },
    {
        "name": "148_a_tied_weight_copied_on_its_owners_rank",
        "file": "autoshard/planner/stages.py",
        "why": "zbv's last stage counts a copy of the embedding it is tied to, though the first stage on the same "
        "rank holds it",
        "tests": ["tests/test_planner_rules.py"],
        "k": "tied_weight_on_one_rank",
    },
    {
        "name": "149_w_keeps_a_fresh_first_gradient",
        "file": "autoshard/graph_ops/weight_grad.py",
        "why": "an earlier W keeps a weight's first gradient of the step as a fresh tensor beside its bucket until the "
        "stage's last W: a weight's bytes a weight held",
        "tests": ["tests/test_zero_bubble.py"],
        "k": "first_gradient_into_its_bucket",
    },
    {
        "name": "150_a_slot_written_by_w_counts_as_unfilled",
        "file": "autoshard/runtime/holders.py",
        "why": "the bucket slot a W wrote is not marked filled, so it is zeroed before the all-reduce",
        "tests": ["tests/test_zero_bubble.py"],
        "k": "first_gradient_into_its_bucket or matches_single_device",
    },
    {
        "name": "151_w_is_half_the_backward",
        "file": "autoshard/planner/simulate.py",
        "why": "the planner's W takes half of each stage's backward, a recomputing stage's repeated forward included",
        "tests": ["tests/test_planner_rules.py"],
        "k": "split_backwards_w",
    },
    {
        "name": "152_an_earlier_w_adds_through_a_product",
        "file": "autoshard/graph_ops/weight_grad.py",
        "why": "an earlier W writes a product of the weight's size and adds it, not one fused multiply-add",
        "tests": ["tests/test_zero_bubble.py"],
        "k": "earlier_w_adds_into",
    },
    {
        "name": "153_an_eager_b_leaves_weight_gradients_to_autograd",
        "file": "autoshard/runtime/pipeline.py",
        "why": "an eager 1F1B's B lets autograd accumulate (a fresh product, then an add) though its matmuls defer",
        "tests": ["tests/test_pipeline.py"],
        "k": "pipeline_matches_single_device",
    },
    {
        "name": "154_zero3_fused_b_armed_before_its_backward",
        "file": "autoshard/runtime/pipeline.py",
        "why": "under ZeRO-3 an eager pipeline's last B arms the reduce-scatter before B: the layer is "
        "reduce-scattered in B and again for the weight gradients B adds after (right sums, twice the collectives)",
        "tests": ["tests/test_zero_bubble.py"],
        "k": "computes_what_1f1b_computes",
    },
    {
        "name": "155_ring_gradients_sent_against_their_blocks",
        "file": "autoshard/graph_ops/ring_attention.py",
        "why": "ring backward sends each block's gradients to the next rank while the blocks go to the previous one: "
        "the partial sums meet other blocks (equal at cp=2, where both neighbours are one rank)",
        "tests": ["tests/test_context_parallel.py"],
        "k": "ring_attention_equals",
    },
    {
        "name": "156_ring_output_heads_first",
        "file": "autoshard/graph_ops/ring_attention.py",
        "why": "ring attention's output is laid out heads-first while the accounting takes it as token-major: the "
        "projection after it keeps a copy nobody counts",
        "tests": ["tests/test_context_parallel.py"],
        "k": "keeps_is_what",
    },
    {
        "name": "157_ring_kept_block_not_counted",
        "file": "passes/saved_tensors.py",
        "why": "the accounting leaves out the K/V block ring attention keeps for its backward",
        "tests": ["tests/test_context_parallel.py"],
        "k": "keeps_is_what",
    },
    {
        "name": "158_cp_local_tokens_keep_the_whole_shape",
        "file": "passes/context_parallel.py",
        "why": "the values cut to a rank's tokens keep the whole sequence's shape: ids counted twice, the loss's "
        "saves not probed",
        "tests": ["tests/test_context_parallel.py"],
        "k": "keeps_is_what",
    },
    {
        "name": "159_planner_pipeline_accumulates_through_autograd",
        "file": "autoshard/planner/costing.py",
        "why": "the planner costs a pipeline's weight-gradient accumulation as autograd's (product, then add), "
        "where its matmuls add theirs fused",
        "tests": ["tests/test_planner_rules.py"],
        "k": "accumulate_fused",
    },
    {
        "name": "160_ranks_outlive_a_killed_parent",
        "file": "autoshard/launch.py",
        "why": "LocalRanks' ranks keep running, holding memory and cores, after their parent is killed",
        "tests": ["tests/test_local_ranks.py"],
        "k": "parent_is_killed",
    },
    {
        "name": "161_unbucketed_expert_grads_not_divided",
        "file": "autoshard/runtime/holders.py",
        "why": (
            "an expert group held by one rank (ep = dp) keeps its gradients unbucketed and forgets to divide them "
            "by dp: the sum over the global batch, not its mean"
        ),
        "tests": ["tests/test_experts.py"],
        "k": "clipping_counts and mixtral",
    },
    {
        "name": "162_the_last_w_fires_no_gradient_hooks",
        "file": "autoshard/graph_ops/weight_grad.py",
        "why": (
            "the stage's last W completes its weights' gradients in place but runs none of their post-accumulate "
            "hooks: the holders never see them arrive and drop them as unused"
        ),
        "tests": ["tests/test_zero_bubble.py"],
        "k": "on_its_edges and pp2-recompute",
    },
    {
        "name": "163_every_w_is_an_arrival",
        "file": "autoshard/graph_ops/weight_grad.py",
        "why": (
            "every W runs its weights' gradient hooks, not only the stage's last: a bucket is reduced before the "
            "later microbatches' gradients are in"
        ),
        "tests": ["tests/test_zero_bubble.py"],
        "k": "on_its_edges and dp2",
    },
    {
        "name": "164_cpu_ranks_step_at_the_copy_bandwidth",
        "file": "autoshard/planner/costing.py",
        "why": (
            "the planner costs a CPU rank's optimizer step at the memory's copy bandwidth, not at the AdamW step's "
            "that Hardware.measure() times (twice as slow as measured on the MoE bench's ranks)"
        ),
        "tests": ["tests/test_planner_closed_forms.py"],
        "k": "hosts_optimizer",
    },
    {
        "name": "165_matmuls_keep_the_inputs_they_could_remake",
        "file": "autoshard/graph_ops/recompute.py",
        "why": (
            "input_recomputed's pack hook keeps every saved tensor: the matmul keeps the norm's or GELU's output "
            "the budget counted as freed, and a forward keeps more than the accounting says"
        ),
        "tests": ["tests/test_recompute.py"],
        "k": "keep_a_recipe or computes_the_same",
    },
    {
        "name": "166_a_recipe_frees_nothing_in_the_budget",
        "file": "passes/recompute_budget.py",
        "why": (
            "the budget's byte count ignores what a recipe frees: no matmul input is ever made again, and the "
            "budget pays for spans instead"
        ),
        "tests": ["tests/test_recompute.py"],
        "k": "keep_a_recipe",
    },
    {
        "name": "167_a_remade_input_counted_as_kept",
        "file": "passes/saved_tensors.py",
        "why": (
            "the accounting counts a matmul's remade input as kept: it reports more than the allocator sees a "
            "forward keep, and budgets are met with bytes that are already free"
        ),
        "tests": ["tests/test_recompute.py"],
        "k": "keep_a_recipe",
    },
    {
        "name": "168_a_remade_input_drops_its_keyword_arguments",
        "file": "autoshard/graph_ops/recompute.py",
        "why": (
            "backward makes a matmul's input again without the producer's keyword arguments: a tanh GELU is made "
            "again as the exact one, and the weight's gradient reads a value forward never computed"
        ),
        "tests": ["tests/test_recompute.py"],
        "k": "computes_the_same",
    },
    {
        "name": "169_a_tied_heads_weight_gradient_in_w_on_its_owners_rank",
        "file": "autoshard/planner/costing.py",
        "why": (
            "the planner costs a tied head's weight gradient in W though its owner (the embedding) runs on the same "
            "rank, where the runtime keeps it in B: zbv's last stage is predicted with too long a W and too short a B"
        ),
        "tests": ["tests/test_planner_rules.py"],
        "k": "keeps_its_gradient_in_b",
    },
    {
        "name": "170_shared_processors_from_one_ranks_affinity",
        "file": "autoshard/planner/calibrate.py",
        "why": (
            "the calibration counts the processors from one rank's affinity: two ranks pinned to a core each are "
            "planned as sharing one, at half their speed"
        ),
        "tests": ["tests/test_planner_rules.py"],
        "k": "shared_processors or pinned",
    },
    {
        "name": "171_no_gap_before_an_action",
        "file": "autoshard/planner/simulate.py",
        "why": "the schedule simulation leaves out the runtime's gap before each action: bubbles predicted short",
        "tests": ["tests/test_planner_rules.py"],
        "k": "gap_before",
    },
    {
        "name": "172_no_gap_before_an_action_on_shared_cores",
        "file": "autoshard/planner/simulate.py",
        "why": "the same on ranks that share processors",
        "tests": ["tests/test_planner_rules.py"],
        "k": "gap_before",
    },
    {
        "name": "173_cpu_ranks_of_their_own_calibrated_one_at_a_time",
        "file": "autoshard/planner/timing.py",
        "why": (
            "CPU ranks with cores of their own are calibrated one at a time, with the memory and its caches to "
            "themselves, where they train all at once"
        ),
        "tests": ["tests/test_planner_rules.py"],
        "k": "computing_at_once",
    },
    {
        "name": "174_no_tied_weights_share_of_w",
        "file": "autoshard/planner/part_times.py",
        "why": "part times carry no tied weight's share of W, so none moves back to B on its owner's rank",
        "tests": ["tests/test_planner_rules.py"],
        "k": "keeps_its_gradient_in_b",
    },
    {
        "name": "175_a_tied_heads_factors_held_for_w_on_its_owners_rank",
        "file": "autoshard/planner/costing.py",
        "why": (
            "the planner counts a tied head's factors (its input, the logits' gradient) as held from B to W where "
            "its gradient stays in B: zbv's memory predicted high"
        ),
        "tests": ["tests/test_planner_rules.py"],
        "k": "keeps_its_gradient_in_b",
    },
    {
        "name": "176_the_microbatch_in_b_counts_ws_inputs_twice",
        "file": "autoshard/planner/memory.py",
        "why": (
            "the microbatch in its B is counted at forward's activations and all of W's factors, though the inputs "
            "W reads are forward's saved tensors: a split backward's memory predicted high"
        ),
        "tests": ["tests/test_planner_rules.py"],
        "k": "in_its_b",
    },
    {
        "name": "177_a_collective_between_the_sizes_timed_on_the_line",
        "file": "autoshard/planner/hardware.py",
        "why": (
            "the cost model reads every collective off the line through the smallest and largest sizes timed: a "
            "2 MiB all-reduce that costs 1.6x the line here is predicted at the line"
        ),
        "tests": ["tests/test_planner_rules.py"],
        "k": "between_the_sizes",
    },
    {
        "name": "178_a_larger_collective_timed_cheaper_is_believed",
        "file": "autoshard/planner/links.py",
        "why": "a size timed faster than a smaller one (noise) makes the sizes between it and the smaller cheaper",
        "tests": ["tests/test_planner_rules.py"],
        "k": "between_the_sizes",
    },
    {
        "name": "179_a_slow_kernels_backward_at_forwards_bytes",
        "file": "autoshard/planner/hardware.py",
        "why": "a kernel with a measured rate costs its backward at forward's bytes: B too short on a CPU",
        "tests": ["tests/test_planner_rules.py"],
        "k": "measured_rate",
    },
    {
        "name": "180_the_tanh_gelu_timed_as_the_erf_one",
        "file": "autoshard/planner/kernels.py",
        "why": "the tanh GELU (4x slower on one core here) is costed at the erf GELU's rate",
        "tests": ["tests/test_planner_rules.py"],
        "k": "named_by_what",
    },
    {
        "name": "181_slow_kernels_costed_at_the_memory_bandwidth",
        "file": "autoshard/planner/part_times.py",
        "why": "the measured kernel rates are ignored in forward: GELU, softmax, dropout masks at a copy's speed",
        "tests": ["tests/test_planner_rules.py"],
        "k": "measured_rate",
    },
    {
        "name": "182_a_dropout_at_p_0_draws_a_mask",
        "file": "autoshard/planner/kernels.py",
        "why": "a dropout that draws nothing (p = 0, or eval) is costed as a mask's draw, 60x a copy or more on a CPU",
        "tests": ["tests/test_planner_rules.py"],
        "k": "named_by_what",
    },
    {
        "name": "183_a_fractional_size_truncated_to_an_integer",
        "file": "autoshard/ir/meta.py",
        "why": "a size evaluated at a share of a row (B = 0.5) truncates it to 0: the planner's bytes per row vanish",
        "tests": ["tests/test_passes.py"],
        "k": "evaluate_expr",
    },
]
