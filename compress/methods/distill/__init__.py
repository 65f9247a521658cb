"""Training on top of accelerate: the generic loop (trainer.py) and knowledge distillation (distill.py)."""
