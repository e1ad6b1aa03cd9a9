//! Chat: turning a conversation into the prompt text a chat model was trained on, and a
//! conversation that keeps its cache between turns.

pub mod session;
pub mod template;
pub mod tools;

pub use session::{Conversation, TurnNotes};
pub use template::{read_messages, ChatTemplate, Message};
