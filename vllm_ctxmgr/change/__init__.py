"""One service's change: its states and record (states), the forward walk (walk), the way back
(states.roll_back), recovery after a kill (recovery), the restart and what it watches (restart,
observing), and the plan a change is made from (planning)."""
