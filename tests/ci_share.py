"""The launch cases CI leaves to the by-hand `slow` run (`make test PYTEST_ARGS="-m slow"`), each beside the case
of the same test that stays in CI and proves the same promise on another backend, optimizer or layout.

CI must finish within its hour on 2 cores; a launched process spends most of its time importing torch,
transformers, peft and DeepSpeed, so each launch costs the suite about as much as any other. conftest marks these
node ids `slow` before `-m` selects, and fails collection when an id here names no collected test (a renamed case
would otherwise drop out of both runs unnoticed)."""

# node id -> the case that stays in CI
SLOW_IN_CI = {
    # N processes equal one, per objective: ZeRO-3 (the sharded case) stays; test_backends.py runs every backend
    "tests/test_distill.py::test_two_processes_equal_one[ddp]": "[zero3]",
    "tests/test_distill.py::test_two_processes_equal_one[fsdp]": "[zero3]",
    "tests/test_kto.py::test_two_processes_equal_one[ddp]": "[zero3]",
    "tests/test_kto.py::test_two_processes_equal_one[fsdp]": "[zero3]",
    "tests/test_reward_training.py::test_two_processes_equal_one[ddp]": "[zero3]",
    "tests/test_reward_training.py::test_two_processes_equal_one[fsdp]": "[zero3]",
    "tests/test_preference_train.py::test_two_processes_equal_one[ddp]": "[zero3]",
    "tests/test_preference_train.py::test_two_processes_equal_one[fsdp]": "[zero3]",
    "tests/test_rl_train.py::test_two_processes_equal_one[ddp]": "[zero3]",
    "tests/test_rl_train.py::test_sampling_from_sharded_weights_equals_one_process_and_holds_no_whole_copy[fsdp]":
        "[zero3]",
    "tests/test_rl_train.py::test_rloo_two_processes_equal_one[ddp]": "[zero3]",
    "tests/test_rl_train.py::test_rloo_two_processes_equal_one[fsdp]": "[zero3]",
    "tests/test_qlora.py::test_two_processes_equal_one[ddp-DDP]": "[zero3-DeepSpeed ZeRO-3]",
    "tests/test_qlora.py::test_two_processes_equal_one[fsdp-FSDP2]": "[zero3-DeepSpeed ZeRO-3]",
    "tests/test_padding_free.py::test_two_ranks_padding_free_equal_one_process_padded[ddp]": "[zero3]",
    "tests/test_samples.py::test_samples_under_sharded_weights_on_two_ranks[fsdp]": "[zero3]",
    "tests/test_precision.py::test_bf16_matches_fp32_within_tolerance[ddp]": "[single], [zero3]",
    "tests/test_precision.py::test_fp16_loss_scaling_skips_overflows_and_trains[ddp]": "[single]",
    "tests/test_estimate.py::test_estimate_matches_bytes_each_rank_holds[ddp]": "[zero3]",
    "tests/test_estimate.py::test_estimate_matches_bytes_each_rank_holds[fsdp]": "[zero3]",
    "tests/test_estimate.py::test_activation_estimate_matches_rss_of_a_real_model[1024-full-0]":
        "[512-full-0], [1024-chunked-128]",
    "tests/test_families.py::test_family_trains[qwen3-moe-lora-zero3]": "[qwen3-moe-lora-single]",
    "tests/test_sequence_parallel.py::test_two_ranks_on_each_sequence_learn_what_one_process_learns[full]": "[lora]",
    "tests/test_checkpoint_size.py::test_a_lora_checkpoint_holds_no_base_weights_and_resumes_bitwise[fsdp]":
        "[single], [zero3]",
    "tests/test_save_verify.py::test_a_checkpoint_that_does_not_read_back_is_never_marked_complete[fsdp-full]":
        "[single-full], [zero3-lora]",
    "tests/test_save_verify.py::test_a_checkpoint_that_does_not_read_back_is_never_marked_complete[zero2-full]":
        "[single-full], [zero3-lora]",
    # kill and resume: one case per mechanism stays
    "tests/test_resume.py::test_sigkill_at_a_random_step_resumes_identically[fsdp]": "[zero3], [sp]",
    "tests/test_resume.py::test_sigkill_at_a_random_step_resumes_identically[ddp_packed]": "[single_lora_dropout]",
    "tests/test_resume.py::test_nonfinite_steps_are_skipped_then_stop_the_run[ddp]": "[single], [zero2]",
    "tests/test_rl_train.py::test_rloo_sigkill_resumes_bitwise": "test_sigkill_resumes_bitwise_and_on_another_backend",
    "tests/test_optim.py::test_a_killed_run_resumes_bitwise[sgd]": "[adamw_8bit]",
    "tests/test_portable_resume.py::test_resume_under_another_layout[single-to-ddp-full]": "[ddp-to-single-full]",
    "tests/test_portable_resume.py::test_resume_under_another_layout[single-to-ddp-lora]": "[zero3-to-fsdp-lora]",
    "tests/test_portable_resume.py::test_resume_under_another_layout[fsdp-to-single-full]": "[ddp-to-single-full]",
    "tests/test_portable_resume.py::test_resume_under_another_layout[single-to-sp-lora]": "[sp-to-single-full]",
    # the optimizer matrix: each optimizer keeps a multi-process case
    "tests/test_optim.py::test_an_optimizer_learns_the_same_under_each_backend_it_accepts[sgd-fsdp]": "[sgd-zero3]",
    "tests/test_optim.py::test_an_optimizer_learns_the_same_under_each_backend_it_accepts[adamw_8bit-ddp]":
        "test_an_optimizer_state_moves_to_another_layout[adamw_8bit-ddp-to-single]",
    "tests/test_optim.py::test_an_optimizer_state_moves_to_another_layout[adafactor-single-to-ddp]":
        "[sgd-zero3-to-fsdp], [adamw_8bit-ddp-to-single]",
    "tests/test_optim.py::test_a_whole_run_steps_at_get_schedulers_rates_across_a_resume[linear]":
        "[warmup_stable_decay]",
    # variants of a run CI makes once
    "tests/test_preference_train.py::test_trls_other_dpo_loss_types_train[loss_type1-weights1]": "[aot-None]",
    "tests/test_benchmarks.py::test_loop_speed_benchmark_runs[padding_free]": "[packed]",
    "tests/test_benchmarks.py::test_loop_speed_benchmark_runs[lora_bf16_base]": "[packed], [optim]",
    "tests/test_config_corpus.py::test_representative_corpus_launch[qwen__ds_config_zero2.json]":
        "test_deepspeed_config.py::test_trainer_style_json_with_optimizer_and_scheduler_trains",
    "tests/test_real_model.py::test_packing_is_isolated_on_the_real_model[eager]": "[sdpa]",
    # the longest cases of the CI run of 2026-12-06 (durations of 95 to 230 s each there)
    "tests/test_backends.py::test_backend_matches_single_process[zero3_nvme-full]":
        "[zero3_offload-full] (async_io is then not built in CI)",
    "tests/test_backends.py::test_backend_matches_single_process[zero3_nvme-lora]": "[zero3_offload-lora]",
    "tests/test_config_corpus.py::test_representative_corpus_launch[axolotl__zero1_torch_compile.json]":
        "test_compile.py::test_compiled_layers_train_as_eager_without_recompiling",
    "tests/test_deepspeed_config.py::test_zero2_run_says_its_schedule_came_from_the_json_and_resumes_under_zero3":
        "test_trainer_style_json_with_optimizer_and_scheduler_trains, "
        "test_portable_resume.py::test_resume_under_another_layout[single-to-zero2-full]",
    "tests/test_long_context.py::test_tiled_mlp_and_activation_offload_learn_the_same_on_every_backend":
        "test_tiled_mlp_runs_each_mlp_in_tiles_and_learns_the_same",
    "tests/test_optim.py::test_loraplus_learns_the_same_under_each_backend[zero3]":
        "test_loraplus_gives_each_parameter_peft_s_rate_and_embeddings_their_own",
    "tests/test_optim.py::test_an_optimizer_state_moves_to_another_layout[sgd-zero3-to-fsdp]":
        "[adamw_8bit-ddp-to-single], test_portable_resume.py::test_resume_under_another_layout[zero3-to-fsdp-lora]",
    "tests/test_optim.py::test_an_optimizer_learns_the_same_under_each_backend_it_accepts[adafactor-ddp]":
        "[muon-ddp], [sgd-zero3]",
    "tests/test_resume.py::test_sigkill_at_a_random_step_resumes_identically[sp]":
        "[zero3], test_portable_resume.py::test_resume_under_another_layout[sp-to-single-full]",
    "tests/test_deepspeed_config.py::test_zero0_trains_with_finite_grad_norms_and_skips_what_is_not_finite":
        "test_backends.py::test_backend_matches_single_process[zero1-full] (the same engine one stage up), "
        "test_resume.py::test_nonfinite_steps_are_skipped_then_stop_the_run[zero2]",
    "tests/test_optim.py::test_a_whole_run_steps_at_get_schedulers_rates_across_a_resume[warmup_stable_decay]":
        "test_every_schedule_is_get_schedulers_across_a_resume (in process), "
        "test_a_warmup_longer_than_the_run_is_cut_to_it",
    "tests/test_config_corpus.py::test_representative_corpus_launch[trl__deepspeed_zero3.yaml]":
        "test_corpus_file_resolves_as_recorded[trl__deepspeed_zero3.yaml] (in process), "
        "test_backends.py::test_backend_matches_single_process[zero3-full]",
    "tests/test_families.py::test_model_recipe_trains_at_toy_size[qwen3-30b-a3b-lora]":
        "test_family_trains[qwen3-moe-lora-single]",
    "tests/test_faults.py::test_signal_while_merge_or_convert_writes_leaves_no_output[convert-INT]": "[merge-TERM]",
}
