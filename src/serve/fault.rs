//! Faults injected on purpose, in debug builds only, so that tests can prove the scheduler
//! survives them: `TINY_DECODER_FAULT=admit` panics once right after a request is admitted
//! (outside a step), `step` panics once inside a step, `fatal` panics inside a step and
//! again while failing its requests (the server must then exit), `slow` makes every step
//! take at least 20 ms (so a test can keep the batch busy). Release builds read no variable.

use std::time::Duration;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Point {
    Admit,
    Step,
    /// Failing the requests after a panic.
    Recover,
}

#[derive(Default)]
pub struct Injector {
    /// The points that panic the next time each is reached.
    armed: Vec<Point>,
    /// Sleep at every step.
    slow: bool,
}

impl Injector {
    pub fn from_env() -> Self {
        if !cfg!(debug_assertions) {
            return Self::default();
        }
        let fault = std::env::var("TINY_DECODER_FAULT").unwrap_or_default();
        let armed = match fault.as_str() {
            "admit" => vec![Point::Admit],
            "step" => vec![Point::Step],
            "fatal" => vec![Point::Step, Point::Recover],
            _ => vec![],
        };
        let slow = fault == "slow";
        Self { armed, slow }
    }

    /// Panics the first time `point` is reached when armed for it.
    pub fn at(&mut self, point: Point) {
        if self.slow && point == Point::Step {
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Some(i) = self.armed.iter().position(|&p| p == point) {
            self.armed.remove(i);
            panic!("TINY_DECODER_FAULT={point:?}: injected scheduler fault");
        }
    }
}
