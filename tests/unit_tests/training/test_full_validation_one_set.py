# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

"""--full-validation with one validation set: evaluate_and_print_results built the tensor of eval
iterations it broadcasts from args.eval_iters, an int there, so the broadcast tensor was 0-d,
its tolist() an int, and eval_iters[0] raised TypeError at the first evaluation. It now uses the
list it made."""

from types import SimpleNamespace

from tests.unit_tests.test_utilities import Utils

from megatron.training import global_vars, training


class TestFullValidationOneSet:
    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        global_vars.unset_global_variables()
        Utils.destroy_model_parallel()

    def test_one_validation_set_evaluates_its_iterations(self, monkeypatch):
        args = SimpleNamespace(
            full_validation=True,
            multiple_validation_sets=False,
            validation_set_names=None,
            eval_iters=3,
        )
        global_vars.set_args(args)
        seen = []

        def evaluate(*_, eval_iters, **__):
            seen.append(eval_iters)
            return {}, None, True  # the time limit: evaluate_and_print_results returns here

        monkeypatch.setattr(training, "evaluate", evaluate)
        # before the fix: TypeError: 'int' object is not subscriptable
        training.evaluate_and_print_results("iteration 1", None, None, None, 1, None, None)
        assert seen == [3] and args.eval_iters == 3
