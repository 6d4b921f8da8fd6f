"""Distillation: a pretrained transformer becomes its hybrid family (data: the teacher-written token stream)."""
