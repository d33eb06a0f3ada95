"""Adapters to the frameworks users already run (PEFT, Transformers 's Trainer), each importing its framework
only when a model or a call needs it: the core never imports them."""
