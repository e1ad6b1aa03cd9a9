//! Chat: turning a conversation into the prompt text a chat model was trained on.

pub mod template;

pub use template::{read_messages, ChatTemplate, Message};
