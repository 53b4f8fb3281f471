"""Experiment drivers built on the training program, run from a checkout (not installed):

    python -m experiments.ablation     convergence of GPT training per codec, over seeds
    python -m experiments.fidelity     codec error on the tensors of real all-reduces
    python -m experiments.arch_fidelity  the same per TP site of the GPT and the Qwen family
    python -m experiments.grad_error   loss and gradient error at a trained run's parameters
"""
