"""The evaluation machinery behind the evaluate stage (docs/evaluation.md): likelihoods (`likelihood`), a
trained checkpoint loaded with its strategy (`trained_model`), samples scored by a frozen causal LM
(`scoring`) beside the data row (`data_row`) and the lm-eval harness's model (`lm_eval_model`); DFlash's acceptance
is the speculative wing's (`tasks.speculative.acceptance`)."""
