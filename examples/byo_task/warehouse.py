"""The stock-room environment of the "Bring your own task" example, written only against TRL
1.16's ``environment_factory`` contract: one instance per episode, ``reset(**row)`` with the
dataset row, its public methods are the model's tools, ``get_reward()`` scores the episode
from the environment's own state. Nothing in it is specific to composer-tune."""


class Warehouse:
    """A stock room holding one item (the row's ``item`` and ``stock`` columns)."""

    def __init__(self) -> None:
        self.item, self.stock, self.looked_up = "", 0, False

    def reset(self, item: str, stock: int, **row) -> None:
        self.item, self.stock, self.looked_up = item, stock, False

    def check_stock(self, item: str) -> str:
        """Look up how many boxes of an item are in stock.

        Args:
            item: The item's name, for example "bolts".
        """
        if item.strip().lower() != self.item:
            return f"No item named {item!r} in this stock room."
        self.looked_up = True
        return str(self.stock)

    def get_reward(self) -> float:
        """0.5 for looking the item up: the tool use the task needs."""
        return 0.5 if self.looked_up else 0.0
