"""Does training improve the model: the losses compared (``loss_compare``), a multi-turn game
(``multiturn``).
"""
